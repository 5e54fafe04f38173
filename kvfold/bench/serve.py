"""Serving in vLLM with one KV memory budget: the original against the export (kvfold-runtime's plugin).

Each model runs in a fresh process (one vLLM engine per process, so neither inherits the other's memory
or compiled code) with the same `kv_cache_memory_bytes`. Reported from vLLM's own accounting:
the KV token capacity it allocated in that budget (blocks × block size), the peak number of requests
it ran at once (its scheduler's `num_running_reqs`, read through a stat logger — vLLM's public hook for
metrics) and its peak KV usage, and for one fixed workload (N requests of P prompt tokens + G generated
tokens, all submitted at once, greedy, EOS ignored) the wall time and tokens/s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvfold.bench.engine_log import root_cause
from kvfold.checkpoint.manifest import Manifest
from kvfold.errors import KVFoldError
from kvfold.sources.models import resolve_model
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer

__all__ = ["bench_serve", "one_engine"]


def _prompts(model_dir: Path, requests: int, tokens: int) -> list[list[int]]:
    """`requests` distinct, consecutive `tokens`-long pieces of wiki:eval (no shared prefixes to cache)."""
    ids = load_tokenizer(model_dir)("\n\n".join(resolve_text("wiki:eval"))).input_ids
    if len(ids) < requests * tokens:
        raise KVFoldError(f"wiki:eval has {len(ids)} tokens, fewer than --requests × --prompt-tokens")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(requests)]


def one_engine(model: str, tokenizer_dir: str, kv_cache_bytes: int, requests: int, prompt_tokens: int,
               new_tokens: int, dtype: str, eager: bool) -> dict:
    """In this process: one vLLM engine, its KV capacity, then the workload."""
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.v1.metrics.loggers import StatLoggerBase

    peaks = {"running": 0, "kv_usage": 0.0, "waiting": 0}

    class Peaks(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                peaks["running"] = max(peaks["running"], scheduler_stats.num_running_reqs)
                peaks["waiting"] = max(peaks["waiting"], scheduler_stats.num_waiting_reqs)
                peaks["kv_usage"] = max(peaks["kv_usage"], scheduler_stats.kv_cache_usage)

        def log_engine_initialized(self) -> None:
            pass

    prompts = _prompts(Path(tokenizer_dir), requests, prompt_tokens)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes, enforce_eager=eager,
                   max_model_len=prompt_tokens + new_tokens, disable_log_stats=False, seed=0),
        stat_loggers=[Peaks])
    startup = time.perf_counter() - t0
    cache = engine.vllm_config.cache_config
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - t0
    return {"model": model, "kv_cache_memory_bytes": kv_cache_bytes, "kv_blocks": cache.num_gpu_blocks,
            "block_size": cache.block_size, "kv_token_capacity": cache.num_gpu_blocks * cache.block_size,
            "peak_running_requests": peaks["running"], "peak_waiting_requests": peaks["waiting"],
            "peak_kv_cache_usage": round(peaks["kv_usage"], 4), "workload_s": round(seconds, 2),
            "generated_tokens": generated, "generated_tokens_per_s": round(generated / seconds, 2),
            "total_tokens_per_s": round((generated + requests * prompt_tokens) / seconds, 2),
            "startup_s": round(startup, 1)}


def _run(model: str, tokenizer_dir: Path, args: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "point.json"
        cmd = [sys.executable, "-m", "kvfold.bench", "serve-point", model, str(tokenizer_dir), str(out)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in args.items() if not isinstance(v, bool)]
        cmd += ["--eager"] if args["eager"] else []
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if done.returncode != 0 or not out.exists():
            raise KVFoldError(f"vLLM run of {model} failed: {root_cause(done.stdout + done.stderr)}")
        return json.loads(out.read_text())


_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def layout_capacities(manifest: Manifest, budget: int, block_size: int, dtype: str) -> dict:
    """KV tokens vLLM gives `budget` bytes under each way to declare per-head widths, by vLLM's page
    formula (a page = block_size × Σ over a layer's declared KV heads of (head_size + head_size_v) × bytes;
    all layers share one block pool): the packed layout kvfold uses (one KV head of Σd_k / Σd_v per
    layer), padding every head of a layer to its widest, and one Attention per bucket of equal widths."""
    per_layer = {"packed": [], "pad_to_layer_max": [], "buckets": []}
    buckets = 0
    for d_k, d_v in zip(manifest.d_k, manifest.d_v, strict=True):
        pairs = list(zip(d_k, d_v, strict=True))
        per_layer["packed"].append(sum(d_k) + sum(d_v))
        per_layer["pad_to_layer_max"].append(len(pairs) * (max(d_k) + max(d_v)))
        per_layer["buckets"].append(sum(k + v for k, v in pairs))
        buckets += len(set(pairs))
    out = {}
    for name, numbers in per_layer.items():
        page = block_size * sum(numbers) * _BYTES[dtype]
        out[name] = {"kv_token_capacity": budget // page * block_size, "page_bytes": page}
    out["buckets"]["attention_calls_per_step"] = buckets
    out["packed"]["attention_calls_per_step"] = out["pad_to_layer_max"]["attention_calls_per_step"] = len(manifest.d_k)
    return out


def bench_serve(export: Path, against: str | None, kv_cache_mib: int, requests: int, prompt_tokens: int,
                new_tokens: int, dtype: str, eager: bool) -> dict:
    manifest = Manifest.load(export)
    source = resolve_model(against or manifest.source.path)
    p = manifest.chosen.compression
    args = {"kv_cache_bytes": kv_cache_mib << 20, "requests": requests, "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "dtype": dtype, "eager": eager}
    original = _run(str(source.path), source.path, args)
    exported = _run(str(export), source.path, args)
    ratio = exported["kv_token_capacity"] / original["kv_token_capacity"]
    return {
        "benchmark": "serve", "engine": "vllm", "export": str(export), "original": str(source.path),
        "compression_p": round(p, 4), "dtype": dtype, "kv_cache_mib": kv_cache_mib,
        "workload": {"requests": requests, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens},
        "runs": {"original": original, "exported": exported},
        # the lead the plugin follows, against the alternatives: capacity by vLLM's page formula
        "layouts": layout_capacities(manifest, args["kv_cache_bytes"], exported["block_size"], dtype),
        "kv_capacity_ratio": round(ratio, 4), "ideal_capacity_ratio": round(1 / (1 - p), 4),
        "capacity_target_met": ratio >= 0.97 / (1 - p),
        "peak_running_ratio": round(exported["peak_running_requests"] / max(1, original["peak_running_requests"]), 4),
        "throughput_ratio": round(exported["total_tokens_per_s"] / original["total_tokens_per_s"], 4),
    }
