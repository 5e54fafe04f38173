"""How far is the bits cache's coder from the best any coder of the same plan could do? (issue 25, item 4)

kvfold-bits stores each band of a head's rotated, DCT-mixed row with b-bit uniform codes and one fitted scale per
token (kvfold_runtime.bands). Rate-distortion theory bounds what any coder of b bits per number can do: a
Gaussian row of energy σ² per number can be stored with squared error D = σ² 2^(−2b) per number and no less, a
limit long vector quantizers approach (trellis-coded or lattice quantizers come within a fraction of a dB of it);
a fixed-rate scalar quantizer stays above it (4 bits on a Gaussian of known variance: uniform 4.7 dB, Lloyd-Max
3.9 dB; a scale per row, side information, brings kvfold's uniform codes to about 3 dB).

This script scores one bits plan (the frontier's: `kvfold_bench/frontier/methods/bits.py`, aware bases,
V_SCALE, the export's band mixing) at a chosen fraction of fp16's bytes with two kinds of cache on the frontier's
own evaluation (`kvfold_bench.frontier.setup.Setup`: wiki:eval + pydoc:eval, 512-token windows):

- "uniform": today's band coder (kvfold_runtime.band_roundtrip), and its measured squared error against the
  limit's, in dB;
- "limit+G": the ideal coder's error, G dB above the limit (research/ideal.py: each band of each token
  row through the Gaussian test channel of its own energy). The plan's bytes stay as they are (scales counted),
  so the comparison is at equal bytes.

With --passkey N it also runs the export's pass-key check (plan/longrange.judge: 10 prompts of N tokens, three
draws of the cache's noise: nudged roundings for the real coder, three noise seeds for the channel).

    .venv/bin/python -m research.coder_bound --bytes 0.2813 --gap 0 --gap 1.53 --gap 3 -o out.json

Each row is printed as it is measured; the JSON (all rows) goes where -o/--json says.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from kvfold.measure.stored import banded
from kvfold.plan.bits import V_SCALE, BitRule, plan_bits
from kvfold.plan.longrange import NUDGES, judge
from kvfold.plan.targets import bit_patches
from kvfold_bench.frontier.setup import Setup
from kvfold_bench.frontier.sweep import Point, meets
from research.ideal import ideal


def plan_at(bases, fraction: float):
    """The eq6 plan (θ_v = V_SCALE·θ_k) whose bytes are closest to `fraction` of fp16's from below."""
    widths = BitRule(1.0, 1.0).widths
    lo, hi = math.log(1e-9), math.log(1.0)  # log θ: small θ keeps more bytes
    for _ in range(40):
        mid = (lo + hi) / 2
        if 1 - plan_bits(bases, BitRule(math.exp(mid), V_SCALE * math.exp(mid), widths)).compression > fraction:
            lo = mid
        else:
            hi = mid
    return plan_bits(bases, BitRule(math.exp(hi), V_SCALE * math.exp(hi), widths))


class Tally:
    """Squared error and the limit's squared error, summed over every quantized band of every call."""

    def __init__(self) -> None:
        self.error, self.limit = 0.0, 0.0

    def db(self) -> float:
        return 10 * math.log10(self.error / self.limit) if self.limit else float("nan")


def _limit(part: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] -> per row the limit's squared error per number, σ² 2^(−2b) (σ²: the row's mean square)."""
    return part.float().square().mean(-1, keepdim=True) * 2.0 ** (-2 * bits)


def uniform(bands_per_head: list, tally: Tally | None, nudge: float = 0.0):
    """Today's band coder (measure/stored.banded), tallying its error against the limit's."""
    store = banded(bands_per_head, nudge)

    def quantize(x: torch.Tensor) -> torch.Tensor:  # [B, H_kv, T, d]
        out = store(x)
        if tally is not None:
            for g, head in enumerate(bands_per_head):
                for band in (b for b in head if b.scaled):
                    at = slice(band.start, band.start + band.size)
                    part = x[:, g, :, at].float()
                    tally.error += float((out[:, g, :, at].float() - part).square().sum())
                    tally.limit += float(_limit(part, band.bits).sum()) * band.size
        return out
    return quantize


def summary(p: Point, target: float) -> dict:
    return {"top1_ratio": round(p.top1_ratio, 4), "ppl_ratio": round(p.ppl_ratio, 4), "ppl_se": round(p.ppl_se, 4),
            "kl": round(p.kl, 5), "agreement": round(p.agreement, 4),
            "texts": [{"top1_ratio": round(q.top1_ratio, 4), "ppl_ratio": round(q.ppl_ratio, 4)} for q in p.parts],
            "joint_target": meets(p, target)}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m research.coder_bound", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--bytes", type=float, action="append", required=True, help="fraction of fp16's KV bytes")
    ap.add_argument("--gap", type=float, action="append", default=[], help="dB above the limit (repeatable)")
    ap.add_argument("--eval-text", default="wiki:eval+pydoc:eval")
    ap.add_argument("--eval-tokens", type=int, default=12288)
    ap.add_argument("--passkey", type=int, default=0, help="prompt length of the pass-key check (0: none)")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("-o", "--json", type=Path, required=True, help="write the JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvfold-bound-") as tmp:
        setup = Setup(args.model, Path(tmp), eval_text=args.eval_text, eval_tokens=args.eval_tokens,
                      calib_tokens=8192, passkey=args.passkey)
        bases = setup.bases("aware", "text")
        original = setup.passkey_original() if args.passkey else None
        rows = []
        for fraction in args.bytes:
            plan = plan_at(bases, fraction)
            kept = 1 - plan.compression
            coders = [("uniform", None)] + [(f"limit+{g:g}dB", g) for g in args.gap]
            for name, gap in coders:
                tally, seeds = Tally(), itertools.count()

                def coder(bands, gap=gap, tally=tally, seeds=seeds):
                    return uniform(bands, tally) if gap is None else ideal(bands, gap, next(seeds))

                point = Point.measured(0.0, kept, setup.score(bit_patches(bases, plan, setup.dtype, coder=coder)),
                                       setup.baseline)
                row = {"kv_fraction": round(kept, 4), "coder": name, "mean_bits": round(plan.mean_bits(), 3),
                       **summary(point, args.target)}
                if gap is None:
                    row["error_above_limit_db"] = round(tally.db(), 2)
                if args.passkey:
                    def draws(gap=gap, plan=plan):  # three draws of the cache's noise
                        for s, nudge in enumerate(NUDGES):
                            seeds = itertools.count(1000 * (s + 1))

                            def draw(bands, nudge=nudge, seeds=seeds):
                                return uniform(bands, None, nudge) if gap is None else ideal(bands, gap, next(seeds))
                            yield setup.passkey_answers(bit_patches(bases, plan, setup.dtype, coder=draw))

                    verdict = judge(original, draws())
                    row["passkeys"] = {"kept": verdict.kept, "counts": verdict.counts, **verdict.margin}
                print(json.dumps(row), flush=True)
                rows.append(row)
        args.json.write_text(json.dumps({
            "model": args.model, "eval_text": args.eval_text, "eval_tokens": setup.baseline.tokens,
            "passkey": args.passkey, "kept_bits_note": "mean bits per number before scales",
            "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
