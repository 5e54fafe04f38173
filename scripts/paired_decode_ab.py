"""Paired batch-1 decode timings in one process: the one-call decode path on and off, or an export against its original.

    .venv/bin/python scripts/paired_decode_ab.py EXPORT                     # one-call path on / off, one engine
    .venv/bin/python scripts/paired_decode_ab.py EXPORT --against-original  # the original's engine and the export's

One request of `--context` wiki:eval prompt tokens per engine (float32, 256 MiB of KV cache, compiled, the engines
in this process), then decode steps in blocks of eight, the first step of each block dropped, the sides' order
rotating (kvfold/bench/serve_paired.py's engines and turns; `--steps`: counted steps in all with one engine, each
with two):
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
from pathlib import Path

DEFAULT_ORIGINAL = Path.home() / ".cache" / "kvfold" / "models" / "SmolLM2-135M-Instruct"
ENGINE = {"kv_cache_bytes": 256 << 20, "dtype": "float32", "eager": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--original", default=str(DEFAULT_ORIGINAL))
    parser.add_argument("--against-original", action="store_true")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=160)
    args = parser.parse_args()

    from kvfold.bench.serve_paired import BLOCK, paired_decode, paired_figures, start_engine, take_turns, turns_for
    from kvfold.bench.serve_point import wiki_eval_ids
    from kvfold_runtime.vllm.backend import KVFoldAttentionImpl

    out = {"export": args.export, "context": args.context}
    if args.against_original:  # what `kvfold-bench serve --paired-steps` does, for one export
        figures = paired_decode({"original": (args.original, "auto"), "export": (args.export, "auto")},
                                args.original, context=args.context, steps=args.steps, **ENGINE)
        original, export = figures["original"], figures["export"]
        out |= {"original_ms": original["ms_per_step"], "export_ms": export["ms_per_step"],
                "export_speed_vs_original": export["vs_original"]}
        print(json.dumps(out))
        return

    layers, init = [], KVFoldAttentionImpl.__init__

    def collect(self, *a, **kw):  # every layer's implementation, as the engine makes them
        init(self, *a, **kw)
        layers.append(self)

    KVFoldAttentionImpl.__init__ = collect
    turns = turns_for(args.steps // 2)  # both sides step the one engine's one request
    prompt = wiki_eval_ids(Path(args.original), args.context)[:args.context]
    engine = start_engine(args.export, "auto", prompt, 2 * turns * BLOCK, **ENGINE)
    made = [layer._decode_layer for layer in layers]
    if not any(made):
        raise SystemExit("no layer runs the one-call path here (not float32 on a CPU with a C compiler?)")

    def switch(on: bool):
        def set_all():
            for layer, one_call in zip(layers, made, strict=True):
                layer._decode_layer = one_call if on else False
        return set_all

    figures = paired_figures(take_turns({"on": (engine, switch(True)), "off": (engine, switch(False))}, turns),
                             original="off")
    on, off = figures["on"]["ms_per_step"], figures["off"]["ms_per_step"]
    out |= {"one_call_ms": on, "separate_calls_ms": off, "saved_ms": round(off - on, 3),
            "saved_fraction": round(1 - on / off, 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
