"""Generation memory with a 4K-token context: the exported model (served by kvfold-runtime) against
the original, each in a fresh process so each peak is its own.

Linux resets a process's peak RSS when "5" is written to /proc/self/clear_refs; the benchmark loads the
model, warms up, resets the peak, then generates, so `generate_peak` is the peak during generation
alone. glibc is told to serve every allocation above 128 KiB by mmap (MALLOC_MMAP_THRESHOLD_), so a
freed tensor leaves RSS at once and the peak counts only what was alive together.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvfold.checkpoint.manifest import Manifest
from kvfold.errors import KVFoldError
from kvfold.sources.models import load_model, resolve_model
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer
from kvfold.verify.runtime import require_runtime

__all__ = ["bench_memory", "one_run"]

_MIB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KVFoldError(f"/proc/self/status has no {field}; this benchmark needs Linux")


def _prompts(model_dir: Path, tokens: int, batch: int) -> torch.Tensor:
    """`batch` consecutive `tokens`-long pieces of wiki:eval (documents joined by blank lines): [batch, tokens]."""
    ids = load_tokenizer(model_dir)("\n\n".join(resolve_text("wiki:eval")), return_tensors="pt").input_ids[0]
    if len(ids) < tokens * batch:
        raise KVFoldError(f"wiki:eval has {len(ids)} tokens, fewer than --context × --batch")
    return ids[: tokens * batch].view(batch, tokens)


def one_run(model: str, exported: bool, context: int, new_tokens: int, batch: int) -> dict:
    """In this process: load, warm up, then measure one greedy generation."""
    with torch.inference_mode():
        if exported:
            require_runtime()
            from transformers import AutoModelForCausalLM

            path = Path(model)
            net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        else:
            ref = resolve_model(model)
            path, net = ref.path, load_model(ref)
        ids = _prompts(path, context, batch)
        weights = sum(p.numel() * p.element_size() for p in net.parameters())
        net.generate(ids[:, :16], max_new_tokens=2, do_sample=False)  # thread pools, lazy inits
        gc.collect()
        before = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
        t0 = time.perf_counter()
        out = net.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           return_dict_in_generate=True)
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM")
        cache = require_runtime().kv_cache_bytes(out.past_key_values)
        cached = out.past_key_values.get_seq_length()
    return {"class": type(net).__name__, "weights_bytes": weights, "rss_before_generate_bytes": before,
            "generate_peak_rss_bytes": peak, "generate_increase_bytes": peak - before, "kv_cache_bytes": cache,
            "cached_tokens_per_sequence": cached, "generate_s": round(seconds, 1)}


def _run(model: str, exported: bool, context: int, new_tokens: int, batch: int) -> dict:
    cmd = [sys.executable, "-m", "kvfold_bench", "memory-point", model, "--context", str(context),
           "--new-tokens", str(new_tokens), "--batch", str(batch)] + (["--exported"] if exported else [])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_ARENA_MAX": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise KVFoldError(f"memory run failed: {last[0].removeprefix('error: ')}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_memory(export: Path, against: str | None, context: int, new_tokens: int, batch: int) -> dict:
    """`generate_increase_saving_mib` is what generation itself needs less (peak during generate() minus
    the resident model); `total_peak_saving_mib` also counts the weights, which RoPE exports grow by
    the post-RoPE projections (a constant, while the cache saving grows with context × batch)."""
    for flag, value in (("--context", context), ("--new-tokens", new_tokens), ("--batch", batch)):
        if value < 1:
            raise KVFoldError(f"{flag} must be at least 1, got {value}")
    manifest = Manifest.load(export)  # a missing folder or one with no kvfold.json fails here, in one line
    source = against or manifest.source.path
    resolve_model(source)  # so does a bad --against, before any run
    original = _run(source, False, context, new_tokens, batch)
    compressed = _run(str(export), True, context, new_tokens, batch)

    def saving(key: str) -> int:
        return original[key] - compressed[key]

    # The peak comes in the prefill (its MLP activations dwarf a decode step), when the cache holds the
    # prompt only; the cache grows linearly afterwards, so its saving then is the final one scaled back.
    cache_saving = saving("kv_cache_bytes")
    prompt_cache_saving = cache_saving * context / original["cached_tokens_per_sequence"]
    return {
        "benchmark": "memory", "export": str(export), "original": str(source), "dtype": "float32",
        "compression_p": round(manifest.chosen.compression, 4), "context_tokens": context, "batch": batch,
        "new_tokens": new_tokens, "runs": {"original": original, "exported": compressed},
        "kv_cache_ratio": round(compressed["kv_cache_bytes"] / original["kv_cache_bytes"], 4),
        "kv_cache_saving_mib": _mib(cache_saving),
        "prompt_kv_cache_saving_mib": _mib(prompt_cache_saving),
        "generate_increase_saving_mib": _mib(saving("generate_increase_bytes")),
        "weights_delta_mib": _mib(-saving("weights_bytes")),
        "total_peak_saving_mib": _mib(saving("generate_peak_rss_bytes")),
    }


def _mib(n: float) -> float:
    return round(n / _MIB, 3)
