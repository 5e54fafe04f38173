"""Batch-1 decode at a long context with every configuration's engine in one process, the engines taking turns
(the hidden `serve-paired` command): the paired speed figure of `kvfold-bench serve`.

Why: engines started one after another on a small shared machine drift apart by more than the gap a 0.95× target
has to resolve (2026-11-29, SmolLM2 at 4K on 2 cores: the original's own three engines decoded at 12.3, 11.3 and
7.7 tokens/s). Engines in one process that take turns see the same drift, so the ratio of their step times is what
the configuration does to a decode step.

How: every engine holds one request of the long workload's prompt (the same wiki:eval tokens), past its prefill
and WARMUP decode steps. Then, turn by turn, each engine runs BLOCK decode steps; the first step of a block is
not counted (it follows another engine's steps on cold caches), and the order of the engines rotates each turn
so none always goes first. Per configuration: the median counted step, and its ratio to the original's, with the
quartiles of the per-turn ratios (how steady the ratio was).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kvfold_bench.serve_point import wiki_eval_ids

__all__ = ["BLOCK", "WARMUP", "paired_decode", "paired_figures", "start_engine", "take_turns", "turns_for"]

WARMUP, BLOCK = 12, 8


def paired_figures(turns: list[dict[str, list[float]]], original: str = "original") -> dict[str, dict]:
    """turns: per turn, each configuration's counted step times (s). Per configuration: the counted steps, the
    median step (ms), decode tokens/s (1 ÷ the median), the ratio of the original's median step to its own
    (its decode speed × the original's) and the quartiles of that ratio turn by turn."""
    def median(name: str) -> float:
        return statistics.median(t for turn in turns for t in turn[name])

    out = {}
    for name in turns[0]:
        per_turn = [statistics.median(turn[original]) / statistics.median(turn[name]) for turn in turns]
        quartiles = statistics.quantiles(per_turn, n=4) if len(per_turn) > 1 else per_turn * 3
        out[name] = {"decode_steps": sum(len(turn[name]) for turn in turns),
                     "ms_per_step": round(1000 * median(name), 3), "decode_tokens_per_s": round(1 / median(name), 2),
                     "vs_original": round(median(original) / median(name), 4),
                     "vs_original_turn_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)]}
    return out


def start_engine(model: str, kv_cache_dtype: str, prompt: list[int], steps: int, kv_cache_bytes: int, dtype: str,
                 eager: bool):
    """An engine holding one request of `prompt`, past its prefill and WARMUP decode steps, with `steps` more
    to go before it finishes."""
    from vllm import EngineArgs, LLMEngine, SamplingParams

    n = WARMUP + steps + 1
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes, kv_cache_dtype=kv_cache_dtype,
        enforce_eager=eager, max_model_len=len(prompt) + n + 1, enable_prefix_caching=False, seed=0))
    engine.add_request("paired", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0))
    # the prefill may take several steps (chunked): step until the first token, then the warm-up steps
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    for _ in range(WARMUP):
        engine.step()
    return engine


def turns_for(steps: int) -> int:
    """Turns that give each side at least `steps` counted steps."""
    return math.ceil(steps / (BLOCK - 1))


def take_turns(sides: dict[str, tuple[object, Callable[[], None]]], turns: int) -> list[dict[str, list[float]]]:
    """sides: name -> (engine, called before each of its blocks). `turns` turns of BLOCK steps a side, the order
    rotating each turn; per turn, each side's counted step times (s)."""
    names, out = list(sides), []
    for turn in range(turns):
        order = names[turn % len(names):] + names[:turn % len(names)]
        times: dict[str, list[float]] = {}
        for name in order:
            engine, before = sides[name]
            before()
            kept = times[name] = []
            for i in range(BLOCK):
                t0 = time.perf_counter()
                engine.step()
                if i:
                    kept.append(time.perf_counter() - t0)
        out.append({name: times[name] for name in names})
    return out


def paired_decode(models: dict[str, tuple[str, str]], tokenizer_dir: str, kv_cache_bytes: int, dtype: str,
                  eager: bool, context: int, steps: int) -> dict:
    """models: configuration -> (model folder, kv_cache_dtype), "original" among them. Every engine in this
    process (the caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0, so each engine core and its worker live here),
    at least `steps` counted decode steps each; paired_figures of the turns."""
    turns = turns_for(steps)
    prompt = wiki_eval_ids(Path(tokenizer_dir), context)[:context]
    engines = {name: start_engine(model, kv_dtype, prompt, turns * BLOCK, kv_cache_bytes, dtype, eager)
               for name, (model, kv_dtype) in models.items()}
    return paired_figures(take_turns({name: (engine, lambda: None) for name, engine in engines.items()}, turns))
