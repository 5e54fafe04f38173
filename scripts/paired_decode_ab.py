"""Paired batch-1 decode timings in one process: the one-call decode path on and off, or an export against its original.

    .venv/bin/python scripts/paired_decode_ab.py EXPORT                     # one-call path on / off, one engine
    .venv/bin/python scripts/paired_decode_ab.py EXPORT --against-original  # the original's engine and the export's

One request of `--context` prompt tokens per engine (float32, 256 MiB of KV cache, compiled, the engines in this
process), then decode steps in blocks of eight, the first step of each block dropped:
- by default the export's steps alternate between the one-call C path (kvfold_decode_layer, "on") and the separate
  write and attention calls ("off": every layer's KVFoldAttentionImpl told it has no one-call path);
- with --against-original the original's engine (--original, default the embedded SmolLM2) and the export's take
  turns, block by block.
Prints JSON: each side's median step in ms and their ratio. Two engines run one after another drift apart by
±10–20% on a small shared machine; sides that take turns in one process see the same drift, so their ratio is what
the change (or the export) did. docs/results.md has the figures. `kvfold-bench serve --paired-steps N` measures the
second mode inside the bench, for every configuration it runs at once.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engines in this process: their layers reachable

import argparse
import json
import statistics
import time
from pathlib import Path

DEFAULT_ORIGINAL = Path.home() / ".cache" / "kvfold" / "models" / "SmolLM2-135M-Instruct"
WARMUP, BLOCK = 12, 8


def _engine(path: str, tokenizer: str, context: int, steps: int):
    """An engine holding one request of `context` prompt tokens, past its prefill and WARMUP decode steps."""
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    n = steps + WARMUP
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=path, tokenizer=tokenizer, dtype="float32", kv_cache_memory_bytes=256 << 20,
        max_model_len=context + n + BLOCK, enable_prefix_caching=False, seed=0))
    prompt = [(i * 7919) % 40000 + 100 for i in range(context)]  # any tokens: only the steps' time matters
    engine.add_request("r", TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0))
    for _ in range(WARMUP):
        engine.step()
    return engine


def _take_turns(sides: dict, steps: int) -> dict[str, float]:
    """sides: name -> (engine, called before each of its blocks); each side's median step (s)."""
    times = {name: [] for name in sides}
    for _ in range(steps // (BLOCK * len(sides))):
        for name, (engine, before) in sides.items():
            before()
            for i in range(BLOCK):
                t = time.perf_counter()
                engine.step()
                if i:
                    times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--original", default=str(DEFAULT_ORIGINAL))
    parser.add_argument("--against-original", action="store_true")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=160)
    args = parser.parse_args()

    from kvfold_runtime.vllm.backend import KVFoldAttentionImpl

    layers, init = [], KVFoldAttentionImpl.__init__

    def collect(self, *a, **kw):  # every layer's implementation, as the engine makes them
        init(self, *a, **kw)
        layers.append(self)

    KVFoldAttentionImpl.__init__ = collect
    export = _engine(args.export, args.original, args.context, args.steps)
    out = {"export": args.export, "context": args.context}
    if args.against_original:
        original = _engine(args.original, args.original, args.context, args.steps)
        median = _take_turns({"original": (original, lambda: None), "export": (export, lambda: None)},
                             2 * args.steps)
        out |= {"original_ms": round(1000 * median["original"], 2), "export_ms": round(1000 * median["export"], 2),
                "export_speed_vs_original": round(median["original"] / median["export"], 4)}
    else:
        made = [layer._decode_layer for layer in layers]
        if not any(made):
            raise SystemExit("no layer runs the one-call path here (not float32 on a CPU with a C compiler?)")

        def switch(on: bool):
            def set_all():
                for layer, one_call in zip(layers, made, strict=True):
                    layer._decode_layer = one_call if on else False
            return set_all

        median = _take_turns({"on": (export, switch(True)), "off": (export, switch(False))}, args.steps)
        out |= {"one_call_ms": round(1000 * median["on"], 2), "separate_calls_ms": round(1000 * median["off"], 2),
                "saved_ms": round(1000 * (median["off"] - median["on"]), 2),
                "saved_fraction": round(1 - median["on"] / median["off"], 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
