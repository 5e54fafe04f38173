"""Time to first token through vLLM's OpenAI-compatible server, an export against its original (issue 50, item 4:
prefill is what a user feels as time to first token, and on a CPU the export's prefill runs kvfold's attention
where the original runs vLLM's own CPU kernel).

Both servers start and run at once, as `vllm serve MODEL` starts them (the server's default dtype unless --dtype
names one; the attention backend: the original's vLLM's own, the export's kvfold's plugin), with a context long
enough for the longest prompt. Each request is one completion of `max_tokens=1` (greedy) whose prompt is a window of
real text given as token ids, every window different, so vLLM's prefix cache never holds a prompt's first block: its
latency is the prefill of the whole prompt plus one sampled token. The servers take turns request by request (their
order alternating), so a load that drifts on a busy machine falls on both alike; one short request each warms them
up first.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold_bench.openai_server import SERVER_DEFAULT, ask, serve_all

__all__ = ["ttft"]

WARMUP_TOKENS = 64


def _prompts(tokenizer_path: Path, text: str, length: int, count: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` token ids of `text`, each from a different place (calib.tokens' packing)."""
    from kvfold.calib.tokens import text_sequences
    from kvfold.sources.text import resolve_text
    from kvfold.sources.tokenizer import load_tokenizer

    seqs = text_sequences(load_tokenizer(tokenizer_path), resolve_text(text), length * count, length, seed=seed)
    windows = [ids.tolist() for ids in seqs.ids if len(ids) == length][:count]
    if len(windows) < count:
        raise KVFoldError(f"--text {text} holds {len(windows)} windows of {length} tokens, not {count}: give a longer "
                          "text (A+B mixes several) or fewer --requests")
    return windows


def ttft(export: Path, original: Path, lengths: list[int], requests: int, text: str = "wiki:eval+pysrc:eval",
         kv_cache_mib: int = 1024, dtype: str | None = None) -> dict:
    """Per prompt length: each server's seconds per request, their medians and the export's ratio to the
    original's; both servers in vLLM's `dtype` (None: the server's default)."""
    names = {"original": original, "export": export}
    prompts = {n: _prompts(export, text, n, requests, seed=n) for n in lengths}
    warm = prompts[lengths[0]][0][-WARMUP_TOKENS:]  # a window's tail: no prompt starts with it (prefix cache)
    seconds: dict[int, dict[str, list[float]]] = {n: {name: [] for name in names} for n in lengths}
    t0 = time.perf_counter()
    with serve_all(names, dtype=dtype, max_model_len=max(lengths) + 1, kv_cache_bytes=kv_cache_mib << 20) as bases:
        started = time.perf_counter()
        for name, base in bases.items():
            _complete(base, str(names[name]), warm)
        for n in lengths:
            for i, prompt in enumerate(prompts[n]):
                order = list(bases) if i % 2 == 0 else list(reversed(bases))
                for name in order:
                    seconds[n][name].append(_complete(bases[name], str(names[name]), prompt))
    rows = []
    for n in lengths:
        med = {name: statistics.median(s) for name, s in seconds[n].items()}
        rows.append({"prompt_tokens": n, "requests": requests,
                     "median_s": {name: round(v, 3) for name, v in med.items()},
                     "ratio": round(med["export"] / med["original"], 3),
                     "seconds": {name: [round(x, 3) for x in s] for name, s in seconds[n].items()}})
    return {"benchmark": "ttft", "server": "vllm.entrypoints.openai.api_server",
            "dtype": dtype or SERVER_DEFAULT,
            "export": str(export), "original": str(original), "text": text,
            "request": "one /v1/completions of max_tokens=1, temperature 0, the prompt as token ids",
            "kv_cache_mib": kv_cache_mib, "startup_s": round(started - t0, 1), "points": rows,
            "total_s": round(time.perf_counter() - t0, 1)}


def _complete(base: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending one completion to its answer."""
    t = time.perf_counter()
    done = ask(base, model, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=900)
    assert done["usage"]["prompt_tokens"] == len(prompt), done["usage"]
    return time.perf_counter() - t
