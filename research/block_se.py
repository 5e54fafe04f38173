"""How long the blocks behind the search's standard errors must be (measure/evaluate.py keeps one a window).

A ratio's standard error treats its blocks of scored tokens as independent samples. Blocks too short understate it
(neighbouring tokens' errors are correlated: the same passage, the same history); whole 4,096-token windows leave two
samples a text, so the error of the error is as large as the error. This script scores an export and its original on
long windows in blocks of 64 tokens, merges neighbours into longer blocks, and writes each text's standard error of
the perplexity and top-1 ratios at each block size: where it stops growing, the blocks are long enough.

    .venv/bin/python -m research.block_se --export Q2 --json docs/block-se-qwen.json    # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from kvfold.calib.tokens import text_sequences
from kvfold.checkpoint.manifest import Manifest
from kvfold.measure.evaluate import Reference, score_model
from kvfold.measure.metrics import Metrics
from kvfold.sources.models import resolve_model
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer
from kvfold.verify.pair import load_original_beside
from kvfold.verify.serving import load_served

UNIT = 64  # the finest block scored


def merged(m: Metrics, per_window: int, k: int) -> Metrics:
    """The same scores in blocks of k units: each window's `per_window` units merged k at a time."""
    def sums(xs):
        xs = list(xs)
        return tuple(sum(xs[w + i:w + min(i + k, per_window)]) for w in range(0, len(xs), per_window)
                     for i in range(0, per_window, k))
    return replace(m, correct=sums(m.correct), window_tokens=sums(m.window_tokens), window_nll=sums(m.window_nll),
                   window_agree=sums(m.window_agree), window_kl=sums(m.window_kl), window_part=())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--text", nargs="+", default=["wiki:dev", "pydoc:dev"])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of each text")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--score-from", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    manifest = Manifest.load(args.export)
    served = load_served(args.export, args.dtype, "cpu")
    original = load_original_beside(served, resolve_model(manifest.source.spec), args.dtype, "cpu")
    tokenizer = load_tokenizer(args.export)
    per_window = (args.context - args.score_from) // UNIT
    out = {"command": "python -m research.block_se " + " ".join(
        f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ' '.join(v)}" for k, v in vars(args).items()),
        "export": str(args.export), "compression": manifest.chosen.compression, "unit": UNIT, "texts": []}
    for text in args.text:
        t0 = time.time()
        windows = text_sequences(tokenizer, resolve_text(text), args.tokens, args.context, seed=0)
        ref = Reference([], [])
        base = score_model(original, windows, 1, keep=ref, start=args.score_from, block=UNIT)
        point = score_model(served, windows, 1, against=ref, start=args.score_from, block=UNIT)
        rows = []
        for k in (1, 2, 4, 8, 16, per_window):
            b, p = merged(base, per_window, k), merged(point, per_window, k)
            rows.append({"block_tokens": k * UNIT, "blocks": len(p.window_nll),
                         "ppl_ratio_se": p.ppl_ratio_se(b), "top1_ratio_se": p.top1_ratio_se(b),
                         "kl_se": p.kl_se()})
        out["texts"].append({"text": text, "windows": len(windows.ids), "tokens": point.tokens,
                             "ppl_ratio": point.ratio(base, "ppl"), "top1_ratio": point.ratio(base, "top1"),
                             "kl": point.kl, "seconds": round(time.time() - t0, 1), "by_block": rows})
        print(json.dumps(out["texts"][-1], default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
