"""Model resolution: a local HF folder, an alias of the embedded default or a Hugging Face Hub id; identity, the
dtype a model runs in (`run_dtype`, the one rule), and loading."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfold.adapters import Adapter, get_adapter
from kvfold.errors import KVFoldError
from kvfold.io import sha256_file
from kvfold.sources.embedded import ALIASES, ensure_embedded
from kvfold.sources.hub import HubModel, is_hub_id, snapshot

__all__ = ["DEVICES", "DEVICE_MAPS", "DTYPES", "ModelRef", "check_device_map", "from_pretrained", "load_model",
           "native_half", "resolve_device", "resolve_model", "run_dtype", "source_dtype", "weights_sha256"]

log = logging.getLogger(__name__)

# The dtype the model *runs* in while kvfold measures it (--dtype). Statistics and factors are float64
# whatever it is, and an export's weights keep the source checkpoint's dtype (export.py).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
DEVICE_MAPS = ("auto",)  # --device-map: accelerate places the layers over the GPUs, the CPU and the disk
WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass(frozen=True)
class ModelRef:
    spec: str  # what the user typed
    path: Path  # the local HF folder
    architecture: str
    adapter: Adapter
    hub: HubModel | None = None  # a Hub id's repository and the commit its snapshot holds


def resolve_model(spec: str) -> ModelRef:
    """Check a model argument before any heavy work: folder, config, supported architecture. An alias, then a
    folder that exists, then a Hub id (`org/name[@revision]`, its snapshot in the Hugging Face cache)."""
    hub = None
    if spec in ALIASES:
        path = ensure_embedded(spec)
    elif Path(spec).exists() or not is_hub_id(spec):
        path = Path(spec)
    else:
        path, hub = snapshot(spec)
    if not path.exists():
        raise KVFoldError(f"model path '{spec}' does not exist; give a local HF model folder, a Hugging Face Hub "
                          f"id (org/name[@revision]) or one of: {', '.join(ALIASES)}")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise KVFoldError(f"'{spec}' is not a HF model folder (no config.json); give a folder written "
                          "by save_pretrained")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KVFoldError(f"cannot read {path / 'config.json'}: {e}; fix or re-save the model") from None
    archs = config.get("architectures") or []
    if not archs:
        raise KVFoldError(f"{path / 'config.json'} names no architecture; re-save it with save_pretrained")
    if not _weight_files(path):
        raise KVFoldError(f"'{spec}' has no weight files (*.safetensors or *.bin)")
    return ModelRef(spec=spec, path=path, architecture=archs[0], adapter=get_adapter(archs[0]), hub=hub)


def resolve_device(spec: str) -> str:
    """--device: auto is cuda when torch sees a CUDA device, else cpu."""
    if spec not in DEVICES:
        raise KVFoldError(f"--device must be one of {', '.join(DEVICES)}, got '{spec}'")
    cuda = torch.cuda.is_available()
    if spec == "cuda" and not cuda:
        raise KVFoldError("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False); "
                          "use --device cpu")
    return ("cuda" if cuda else "cpu") if spec == "auto" else spec


def load_model(ref: ModelRef, dtype: str = "float32", device: str = "cpu", device_map: str | None = None):
    """The model in `dtype` on `device`. Weights are read once, straight into `dtype` (an 8B model in
    bfloat16 never exists in float32), then moved; with `device_map` placed by accelerate (from_pretrained)."""
    safetensors = {"use_safetensors": True} if ref.hub else {}  # a Hub model: never pickle
    return from_pretrained(ref.path, dtype, device, device_map, name=ref.spec, **safetensors)


def check_device_map(device_map: str | None) -> str | None:
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise KVFoldError(f"--device-map must be {' or '.join(DEVICE_MAPS)}, got '{device_map}'")
    return device_map


def from_pretrained(path: Path, dtype: str, device: str, device_map: str | None = None, *, name: str | None = None,
                    **kwargs):
    """AutoModelForCausalLM.from_pretrained(path) in `dtype`, in eval mode, on `device`; or with device_map "auto"
    placed by accelerate over the memory it may use (accelerate's own estimate, or KVFOLD_MAX_MEMORY, e.g.
    "0=20GiB,cpu=60GiB"; with --device cpu the CPU's alone), the rest offloaded to a temporary folder and read back
    layer by layer in each forward pass. Everything then runs on one device (`device`, where accelerate's hooks
    bring each layer), and the embeddings must be there: inputs and kvfold's attention patches go where they are."""
    from transformers import AutoModelForCausalLM

    placed: dict = {}
    if device_map is not None:
        placed = dict(device_map=check_device_map(device_map), max_memory=_max_memory(device),
                      offload_folder=tempfile.mkdtemp(prefix="kvfold-offload-"))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], **placed, **kwargs)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KVFoldError(f"cannot load model '{name or path}': {first}") from None
    if not placed:
        return model.to(device).eval()
    weakref.finalize(model, shutil.rmtree, placed["offload_folder"], ignore_errors=True)  # gone with the model
    first = next(model.parameters())
    if first.device.type == "meta":
        raise KVFoldError(f"--device-map auto: the memory given leaves no room on {device} for the embeddings of "
                          f"'{name or path}' (all offloaded); raise KVFOLD_MAX_MEMORY")
    log.info("--device-map auto: %s", ", ".join(f"{n or 'model'} on {d}" for n, d in model.hf_device_map.items()))
    return model.eval()


def _max_memory(device: str) -> dict:
    """KVFOLD_MAX_MEMORY ("0=20GiB,cpu=60GiB") or accelerate's estimate; with --device cpu only the CPU's entry."""
    from accelerate.utils import get_max_memory

    given = os.environ.get("KVFOLD_MAX_MEMORY", "").strip()
    try:
        raw = {(int(k) if k.strip().isdigit() else k.strip()): v.strip()
               for k, v in (item.split("=", 1) for item in given.split(","))} if given else None
        memory = get_max_memory(raw)
    except (ValueError, TypeError) as e:
        raise KVFoldError(f"KVFOLD_MAX_MEMORY='{given}' is not like '0=20GiB,cpu=60GiB': {e}") from None
    return {k: v for k, v in memory.items() if k in ("cpu", "disk")} if device == "cpu" else memory


def source_dtype(ref: ModelRef) -> str:
    """The dtype the checkpoint's config declares (float32 when it declares none we know)."""
    config = json.loads((ref.path / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    return declared if declared in DTYPES else "float32"


def run_dtype(ref: ModelRef, requested: str = "auto", device: str = "cpu") -> str:
    """The dtype a model runs in, in every stage (calibrate, the search, the pass keys, verify): the one rule.
    An explicit --dtype wins; `auto` is the checkpoint's own dtype on CUDA and on a CPU with native instructions
    for it (bfloat16: AVX512-BF16 or AMX), else float32. Without them a CPU multiplies bfloat16 on a fallback path:
    0.3 GFLOP/s against float32's 29 on a 2-core AVX2 EPYC (measured 2026-11-27), so a 1.5B model's 512-token
    window took minutes instead of seconds. Logged, with why: at INFO where auto chose for a half-precision
    checkpoint, at DEBUG where nothing was chosen (--dtype given, or a float32 checkpoint)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise KVFoldError(f"--dtype must be one of auto, {', '.join(DTYPES)}, got '{requested}'")
        log.debug("dtype: %s (--dtype)", requested)
        return requested
    own = source_dtype(ref)
    if own == "float32":
        log.debug("dtype: float32, the model's own (--dtype auto)")
        return own
    if device != "cpu" or native_half(own):
        why = "CUDA" if device != "cpu" else f"this CPU multiplies {own} natively"
        log.info("dtype: %s, the model's own (--dtype auto: %s)", own, why)
        return own
    log.info("dtype: float32 (--dtype auto): the model is %s, and this CPU has no native %s instructions "
             "(AVX512-BF16, AMX), where it runs ~100x slower; --dtype %s forces it", own, own, own)
    return "float32"


@functools.cache
def native_half(dtype: str) -> bool:
    """Whether this CPU multiplies `dtype` (bfloat16, float16) natively, the question `run_dtype` asks: whether a
    `dtype` matmul runs at least half as fast as float32 here (11x slower at this size where it is not): what the
    CPU's instructions allow, asked of torch by doing rather than by its private CPU probes. Smaller products do not
    tell (128×256×256: 1.7x; float32 is not yet at full speed there). Each side is the fastest of a few calls: one
    call each was measured to answer differently in two stages on one machine (an AVX512-BF16 EPYC, 2026-12-05:
    calibrate said float32 while a test ran beside it, export bfloat16), and every stage must choose alike."""
    g = torch.Generator().manual_seed(0)  # not the global generator: asking must not move anyone's seed
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 512, generator=g)

    def seconds(dt: torch.dtype, calls: int) -> float:
        x, y = a.to(dt), b.to(dt)
        x @ y  # first call: any one-time setup
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - t0)
        return min(times)

    # float32's best of 5 (~1 ms each), the half type's of 3 (~0.6 s each where it is slow)
    return seconds(DTYPES[dtype], 3) <= 2 * seconds(torch.float32, 5)


def weights_sha256(path: Path) -> str:
    """One digest over every weight file (name and content), so any changed byte changes it."""
    h = hashlib.sha256()
    for f in _weight_files(path):
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def _weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
