"""Where a bits plan loses SmolLM2's 4K pass keys: each layer's, and each side's (keys, values), share of the damage.

At a fixed share of fp16's bytes (a windowed plan as export makes it: 16 sinks and the last 64 tokens whole, 8-dim
bands, θ_v = V_SCALE·θ_k), the pass-key margins of the prompts the original wins by least are read with every layer's
cache rounded, with only the keys rounded, only the values, and with one layer at a time rounded (the rest whole).
If the loss sits in a few layers, spending bits there (per-layer θ) keeps the keys at fewer bytes than raising θ
everywhere does. A note for choosing what to build, not a claim.

    .venv/bin/python -m research.passkey_layers --share 0.25 --split --layers    # ~1 hour on 2 cores
    .venv/bin/python -m research.passkey_layers --share 0.25 0.22 --key-min 3 2 --split

Read 2026-12-05 (the two prompts the original wins by 0.26 and 0.29 nats; margins after): at 0.25 of fp16's bytes with
keys ≥ 4 bits (keys 4.25 bits a number, values 2.7) every layer rounded −0.29 on the second, keys alone +0.35 / +0.23
(no loss), values alone −0.01 / −0.15: the values lose the keys. One layer at a time, the values' loss sits mostly in
layers 1 (0.14 / 0.23), 0 and 8, the others within ±0.05 of the original, so no few layers hold it. Keys ≥ 3 bits at
0.25 (keys 3.85, values 3.01): values alone +0.17 / +0.19, keys alone +0.19 / +0.53; at 0.22 (keys 3.43, values 2.51)
every layer rounded −0.07 / −0.25 — lost again.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from kvfold.hooks import patched
from kvfold.measure.passkey import passkey_answers
from kvfold.measure.stored import banded, compressed
from kvfold.plan.bits import KEY_MIN_BITS, V_SCALE, bit_factors
from kvfold_bench.frontier.setup import Setup
from research.passkey_split import at_share


def whole(x):
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=float, nargs="+", default=[0.25])
    parser.add_argument("--sinks", type=int, default=16)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=2, help="the prompts the original wins by least")
    parser.add_argument("--calib-tokens", type=int, default=16384)  # scripts/demo.sh's calibration
    parser.add_argument("--split", action="store_true", help="also keys alone, values alone, neither")
    parser.add_argument("--layers", action="store_true", help="also one layer at a time")
    parser.add_argument("--key-min", type=int, nargs="+", default=[KEY_MIN_BITS])
    parser.add_argument("--v-scale", type=float, default=V_SCALE)
    args = parser.parse_args()
    setup = Setup("smollm2", Path(tempfile.mkdtemp()), calib_tokens=args.calib_tokens, passkey=4096)
    original = setup.passkey_original()
    keep = sorted(range(len(original.margins)), key=original.margins.__getitem__)[:args.prompts]
    prompts = [setup._prompts[i] for i in keep]
    print("original margins:", [round(original.margins[i], 3) for i in keep], flush=True)
    bases = setup.bases("aware", "text")
    like = next(setup.model.parameters())
    for key_min in args.key_min:
        for share in args.share:
            print(f"keys ≥ {key_min} bits:", flush=True)
            plan = at_share(bases, share, 8, args.v_scale, args.sinks, args.window, key_min)
            read(setup, prompts, bases, plan, like, args)


def read(setup, prompts, bases, plan, like, args) -> None:
    """Print the margins of `prompts` with the cache of `plan` rounded in the places args asks for."""
    factors = bit_factors(bases, plan)
    exact = (plan.sinks, plan.window)

    def side_bits(side, layer=None):
        rows = [h for i, heads in enumerate(getattr(plan, f"{side}_bits")) if layer in (None, i) for h in heads]
        return sum(map(sum, rows)) / (plan.head_dim * len(rows))

    print(f"share {1 - plan.compression:.4f}, mean bits {plan.mean_bits():.2f} (keys {side_bits('k'):.2f}, values "
          f"{side_bits('v'):.2f})", flush=True)

    def margins(rounded: set[tuple[int, str]]) -> list[float]:
        patches = {i: replace(compressed(f, like, banded(plan.bands("k", i)) if (i, "k") in rounded else whole,
                                         banded(plan.bands("v", i)) if (i, "v") in rounded else whole), exact=exact)
                   for i, f in enumerate(factors)}
        with patched(setup.model, setup.adapter, patches):
            return [round(m, 3) for m in passkey_answers(setup.model, prompts).margins]

    layers = range(len(factors))
    print("  all rounded:", margins({(i, s) for i in layers for s in "kv"}), flush=True)
    if args.split:
        print("  whole (kept dims only):", margins(set()), flush=True)
        print("  keys rounded:", margins({(i, "k") for i in layers}), flush=True)
        print("  values rounded:", margins({(i, "v") for i in layers}), flush=True)
    if args.layers:
        for i in layers:
            print(f"  layer {i:2d} (keys {side_bits('k', i):.2f} bits, values {side_bits('v', i):.2f}) rounded alone:",
                  margins({(i, "k"), (i, "v")}), flush=True)

if __name__ == "__main__":
    main()
