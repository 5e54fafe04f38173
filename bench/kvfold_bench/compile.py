"""`kvfold-bench compile`: the whole compile of one model — calibrate → export (the accuracy search, the
pass-key check, bake and write; the sensitivity pass too under that allocation) → verify — timed stage by
stage, with each stage's peak memory.

Each stage is the real `kvfold` command, run in its own process (`python -m kvfold ...`, see _STAGE), so its
peak RSS is its own (os.wait4) and its peak CUDA memory is torch's high-water mark inside it. This module never
imports kvfold.cli: the bench sits beside the product's CLI, not on top of it.

Shapes: `smollm2` and `qwen2.5-coder-1.5b` are real models (the aliases of `kvfold prepare`; the coder model
calibrates on wiki + Python source, searches on wiki:dev+pysrc:dev and is verified on wiki, pydoc and pysrc).
`llama3-8b` and `qwen2-7b` are those architectures' exact
configs with seeded random weights, written to a temporary folder in the bench's dtype with SmolLM2's
tokenizer (its ids fit both vocabularies): real 8B weights are not reachable here, and the code path is the
same. Random weights have no meaningful accuracy, so for them the export's target is one every candidate
meets (perplexity ratio ≤ 10⁶, no margin): the search then walks its full path of 10 candidates (the
mildest, 8 bisection steps, the strongest), scoring each distinct rank set once on the search tokens — a real
0.99 search on SmolLM2 scores 9. The JSON says how many were scored.
Their verify verdicts are reported but mean nothing. `tiny-llama` is a two-layer model for the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["SHAPES", "TEXTS", "bench_compile"]

# real models' texts: (calibrate --text, export --eval-text, verify --eval-text ...); others use the defaults
TEXTS = {"qwen2.5-coder-1.5b": ("wiki:calib+pysrc:calib", "wiki:dev+pysrc:dev",
                                ("wiki:eval", "pydoc:eval", "pysrc:eval"))}

# `python -m kvfold ARGS` (runpy runs kvfold/__main__.py as -m does), plus one exit hook: torch's CUDA
# high-water mark of the process, to the file named before ARGS. atexit hooks run after the CLI's SystemExit.
_STAGE = """\
import atexit, json, runpy, sys

peak_file = sys.argv.pop(1)


def write_peak():
    torch = sys.modules.get("torch")
    used = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    try:  # this process's own peak since exec (ru_maxrss of a child also counts its parent's RSS at fork)
        hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
        rss_kib = int(hwm[0].split()[1]) if hwm else None
    except OSError:
        rss_kib = None
    with open(peak_file, "w") as f:
        json.dump({"cuda_peak_bytes": torch.cuda.max_memory_allocated() if used else None, "rss_peak_kib": rss_kib}, f)


atexit.register(write_peak)
runpy.run_module("kvfold", run_name="__main__", alter_sys=True)
"""

# The stages' activations, measured apart (issue 52): a process loads the model as a stage does, reads every weight
# once (transformers maps the safetensors files: a weight's pages join the RSS at first use), resets its high-water
# mark (/proc/self/clear_refs "5") and runs one piece of one stage's work at its real size: the peak above the RSS
# before it is that piece's working memory. Each piece runs in a fresh process: in a shared one, memory the
# allocator kept from an earlier piece hid part of the next one's (the same score probe read 755 and 1,345 MiB).
# calibrate: one batch of calibration (calib.run.collect, 8 × 512 tokens); score: one batch of 4 × 512-token
# windows scored (the search's and verify's batch); passkey: one pass-key prompt of the check's length (4,096
# tokens). Arguments: MODEL DTYPE DEVICE PROBE OUT.
_PROBE = """\
import json, sys
import torch
from kvfold.adapters import HeadLayout
from kvfold.calib.run import collect
from kvfold.calib.tokens import text_sequences
from kvfold.measure.evaluate import score_model
from kvfold.measure.passkey import passkey_answers, passkey_length, passkey_prompts
from kvfold.sources.models import load_model, resolve_model
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer

model, dtype, device, probe, out = sys.argv[1:6]


def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])


ref = resolve_model(model)
net = load_model(ref, dtype, device)
with torch.inference_mode():  # every weight read once: a mapped file's pages are in RSS from their first use
    for p in net.parameters():
        p.sum()
tokenizer = load_tokenizer(ref.path)
windows = text_sequences(tokenizer, resolve_text("wiki:dev"), 8 * 512, 512, seed=0)
seqs = windows.head(8)
prompt = passkey_prompts(tokenizer, passkey_length(net, 4096))[:1]
probes = {"calibrate": lambda: collect(net, ref.adapter, seqs, 8),
          "score": lambda: score_model(net, windows.head(4), 4),
          "passkey": lambda: passkey_answers(net, prompt)}
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")
with torch.inference_mode():
    probes[probe]()
json.dump({"loaded_rss_kib": before, "probe_kib": status("VmHWM:") - before}, open(out, "w"))
"""

_LLAMA_TOKENS = dict(bos_token_id=1, eos_token_id=2)  # SmolLM2's tokenizer's ids
SHAPES: dict[str, dict | None] = {
    "smollm2": None,  # the real weights
    "qwen2.5-coder-1.5b": None,
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, **_LLAMA_TOKENS),
    # Qwen/Qwen2-7B config.json
    "qwen2-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     use_sliding_window=False, tie_word_embeddings=False, **_LLAMA_TOKENS),
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=True, **_LLAMA_TOKENS),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def bench_compile(shape: str, device: str, dtype: str, verify_dtype: str, tokens: int, fmt: str = "rank",
                  search_steps: int | None = None) -> dict:
    from kvfold.sources.models import DTYPES, resolve_device

    if shape not in SHAPES:  # any other MODEL (a folder or a Hugging Face Hub id): its real weights
        from kvfold.sources.models import resolve_model

        try:
            resolve_model(shape)
        except KVFoldError as e:
            raise KVFoldError(f"--shape must be one of {', '.join(SHAPES)} or a model: {e}") from None
    for flag, value in (("--dtype", dtype), ("--verify-dtype", verify_dtype)):
        if value not in DTYPES:
            raise KVFoldError(f"{flag} must be one of {', '.join(DTYPES)}, got '{value}'")
    if tokens < 1:
        raise KVFoldError(f"--tokens must be at least 1, got {tokens}")
    if fmt not in ("rank", "bits"):
        raise KVFoldError(f"--format must be rank or bits, got '{fmt}'")
    device = resolve_device(device)
    if device == "cpu" and shape.endswith(("-7b", "-8b")):
        raise KVFoldError(f"--shape {shape} is a GPU benchmark (its calibration alone would take hours on a CPU); "
                          "run it with --device cuda, or use --shape smollm2 here")
    with tempfile.TemporaryDirectory(prefix="kvfold-bench-compile-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        model = _model(shape, root / "model", dtype, device)
        build_s = time.perf_counter() - t0
        calib, out = root / "calib", root / "export"
        common = ["--device", device]
        random = SHAPES.get(shape) is not None
        target = ["--accuracy", "1e-6", "--metric", "ppl", "--margin", "0"] if random else ["--accuracy", "0.99"]
        calib_text, search, checked = TEXTS.get(shape, ("wiki:calib", None, ()))
        search_args = [] if search is None else ["--eval-text", search]
        if search_steps is not None:  # a shorter search: fewer candidates, the same peak memory (issue 52)
            search_args += ["--search-steps", str(search_steps)]
        verify_args = [arg for text in checked for arg in ("--eval-text", text)]
        stages = [
            ("calibrate", ["calibrate", model, "--source", "text", "--text", calib_text, "--tokens", str(tokens),
                           "--dtype", dtype, "-o", str(calib), *common]),
            ("export", ["export", model, "--calib", str(calib), *target, "--format", fmt, *search_args,
                        "--eval-tokens", str(tokens), "--dtype", dtype, "-o", str(out), *common]),
            ("verify", ["verify", str(out), "--against", model, *verify_args, "--eval-tokens", str(tokens),
                        "--dtype", verify_dtype, "--json", *common]),
        ]
        results = []
        for name, args in stages:
            results.append(_timed(name, args, root))
            if name != "verify" and results[-1]["rc"] != 0:
                raise KVFoldError(f"bench compile: kvfold {name} failed (exit {results[-1]['rc']}): "
                                  f"{results[-1]['stderr_tail']}")
        from kvfold_runtime import MANIFEST

        manifest = json.loads((out / MANIFEST).read_text())
        report = json.loads(results[-1].pop("stdout") or "{}")
        model_bytes = _model_bytes(model)
        activations = _activations(model, dtype, device, root)
    _bound(results, model_bytes, activations)
    scored = results[1]["candidates_scored"]
    for r in results:
        r.pop("stdout", None)
        r.pop("candidates_scored", None)
    return {
        "benchmark": "compile", "shape": shape, "format": fmt, "random_weights": random, "device": device,
        "dtype": dtype,
        "verify_dtype": verify_dtype, "tokens": tokens, "search_steps": search_steps, "threads": _threads(),
        "build_model_s": round(build_s, 1),
        "stages": results, "total_s": round(sum(r["wall_s"] for r in results), 1),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
        "model_mib": round(model_bytes / 2**20, 1), "activations_mib": activations, "rss_bound": _BOUND_NOTE,
        "cuda_peak_mib": max((r["cuda_peak_mib"] or 0) for r in results) if device == "cuda" else None,
        "export": {"candidates_scored": scored, "allocation": manifest["allocation"],
                   "compression": manifest["chosen"]["compression"], "target": manifest["target"]},
        "verify": {"ok": report.get("ok"), "failed": [c["name"] for c in report.get("checks", []) if not c["ok"]],
                   "meaningful": not random,
                   "checks": [{k: c.get(k) for k in ("name", "ok", "detail")} for c in report.get("checks", [])]},
    }


def _model(shape: str, folder: Path, dtype: str, device: str) -> str:
    """The model argument for the stages: the embedded default, or a random-weight folder written now (with the
    default's tokenizer: only its tokenizer files are read, so a GPU machine needs no copy of its weights)."""
    from kvfold.sources.embedded import ensure_embedded

    if SHAPES.get(shape) is None:
        return shape  # a real model: an alias, a folder or a Hub id
    smollm2 = ensure_embedded("smollm2")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvfold.sources.models import DTYPES

    raw = dict(SHAPES[shape])
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    with torch.device(device):  # initialise where it will run: an 8B model's init on the CPU takes minutes
        net = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    net.save_pretrained(folder)
    del net
    if device == "cuda":
        torch.cuda.empty_cache()  # the stages run in child processes: leave them the whole GPU
    for name in _TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, folder / name)
    return str(folder)


# Issue 52's bound on each stage's peak RSS: the model's bytes once, 30% for everything else the process holds
# (Python, torch and transformers themselves, the statistics, the tokenizer), plus the stage's activations
# (_PROBE): export's and verify's are one scored batch or one pass-key prompt, whichever is larger.
_SLACK = 1.3
_STAGE_PROBES = {"calibrate": ("calibrate",), "export": ("score", "passkey"), "verify": ("score", "passkey")}
_BOUND_NOTE = (f"peak RSS of a stage <= {_SLACK} x the model's weight files + the stage's activations (the larger of "
               "its probes in activations_mib, each measured in a fresh process on the model loaded alone)")


def _model_bytes(model: str) -> int:
    """The bytes of the model's weight files, as the stages load them."""
    from kvfold.sources.models import resolve_model

    return sum(p.stat().st_size for p in resolve_model(model).path.glob("*.safetensors"))


def _activations(model: str, dtype: str, device: str, root: Path) -> dict:
    """_PROBE, each piece in a process of its own: MiB of RSS after loading, and each piece's working memory."""
    result = {}
    for probe in ("calibrate", "score", "passkey"):
        out = root / f"probe-{probe}.json"
        done = subprocess.run([sys.executable, "-c", _PROBE, model, dtype, device, probe, str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise KVFoldError(f"bench compile: the {probe} activation probe failed: "
                              f"{done.stderr.strip().splitlines()[-1:]}")
        read = json.loads(out.read_text())
        result.setdefault("loaded_rss_mib", round(read["loaded_rss_kib"] / 1024, 1))
        result[f"{probe}_mib"] = round(read["probe_kib"] / 1024, 1)
    return result


def _bound(results: list[dict], model_bytes: int, activations: dict) -> None:
    """Each stage's activations, its RSS bound and whether its peak is within it (in place)."""
    for r in results:
        act = max(activations[f"{p}_mib"] for p in _STAGE_PROBES[r["stage"]])
        bound = _SLACK * model_bytes / 2**20 + act
        r.update(activations_mib=act, rss_bound_mib=round(bound, 1), within_bound=r["peak_rss_mib"] <= bound,
                 peak_over_model=round(r["peak_rss_mib"] / (model_bytes / 2**20), 2))


def _timed(name: str, args: list[str], root: Path) -> dict:
    """Run `kvfold ARGS` in a child process: wall seconds, its own peak RSS, and its peak CUDA memory."""
    peak = root / f"{name}.peak.json"
    cmd = [sys.executable, "-c", _STAGE, str(peak), *args]
    t0 = time.perf_counter()
    with open(root / f"{name}.out", "w+") as out, open(root / f"{name}.err", "w+") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    peaks = json.loads(peak.read_text()) if peak.is_file() else {}
    cuda = peaks.get("cuda_peak_bytes")
    # the stage's own VmHWM; ru_maxrss (the fallback) starts at this process's RSS when it forked the stage, and
    # this process may hold a model it just wrote
    rss_kib = peaks.get("rss_peak_kib") or usage.ru_maxrss
    return {"stage": name, "rc": child.returncode, "wall_s": round(wall, 1),
            "peak_rss_mib": round(rss_kib / 1024, 1),
            "cuda_peak_mib": None if cuda is None else round(cuda / 2**20, 1),
            "stdout": stdout, "stderr_tail": " | ".join(stderr.strip().splitlines()[-3:]),
            "candidates_scored": sum(" candidate p=" in line for line in stderr.splitlines())}


def _threads() -> int:
    import torch

    return torch.get_num_threads()
