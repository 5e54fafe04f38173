"""What aligning the bits format's bands to 16-dim chunks costs, in the allocator's own model (issue 50, item 4).

The water-filling (kvfold/plan/bits.py) prices a head's widths by its modelled distortion Σ_j λ̂_j·2^(−2b_j) (a
dropped dim λ̂_j). With aligned bands (BitRule.align, formats/bits.ALIGN) the widths are constant on each chunk of 16
dims: a constrained optimum, so its distortion at equal bits is at least the unaligned one's. This script measures
by how much, on synthetic log-linear spectra σ_j = 10^(−decay·j/(d−1)), no model needed: a population of KV heads of
random decay (1–5 decades over the head) planned with one θ as export plans them (θ_v = V_SCALE·θ_k, keys at
KEY_MIN_BITS or more), each allocation's θ bisected to the same mean bits per number (code bits, or code + scale
bits), and the mean modelled distortion over the heads compared in dB (on SmolLM2 the KL doubled with every 3 dB of
coder error, docs/notebook.md). A model, not a measurement: what a model's KL pays is for the frontier to say
(kvfold-bits against kvfold-bits-unaligned). The one-θ plans are discrete, so a point can come out slightly negative.

    .venv/bin/python -m research.align_cost            # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import math

import torch

from kvfold.plan.bits import ALIGN, V_SCALE, BitRule, _key_widths, dim_bits, modelled_distortion

__all__ = ["cost_db", "log_linear"]

WIDTHS = BitRule(1.0, 1.0).widths


def log_linear(d: int, heads: int, seed: int = 0) -> list[torch.Tensor]:
    """`heads` descending spectra of `d` dims, each falling 1–5 decades (uniformly drawn) from its first dim."""
    g = torch.Generator().manual_seed(seed)
    return [10 ** (-(1 + 4 * float(torch.rand(1, generator=g))) * torch.linspace(0, 1, d, dtype=torch.float64))
            for _ in range(heads)]


def _plan(heads: list[torch.Tensor], theta: float, align: int) -> tuple[float, float, float, float]:
    """(code bits, scale bits per number, mean key distortion, mean value distortion) of one θ's plan."""
    keys = [dim_bits(s, theta, _key_widths(WIDTHS), 8, align) for s in heads]
    values = [dim_bits(s, V_SCALE * theta, WIDTHS, 8, align) for s in heads]
    numbers = sum(len(b) for b in keys + values)
    scale = sum(8 * len({x for x in b if 0 < x < 16}) for b in keys + values) / numbers
    dk = sum(modelled_distortion(s, b) for s, b in zip(heads, keys, strict=True)) / len(heads)
    dv = sum(modelled_distortion(s, b) for s, b in zip(heads, values, strict=True)) / len(heads)
    return sum(map(sum, keys + values)) / numbers, scale, dk, dv


def _at_bits(heads: list[torch.Tensor], bits: float, align: int, with_scales: bool) -> tuple[float, ...]:
    lo, hi = math.log(1e-9), math.log(1.0)
    for _ in range(40):  # the smallest θ whose plan stores at most `bits` per number
        mid = (lo + hi) / 2
        code, scale, *_ = _plan(heads, math.exp(mid), align)
        lo, hi = (mid, hi) if code + (scale if with_scales else 0.0) > bits else (lo, mid)
    return _plan(heads, math.exp(hi), align)


def cost_db(heads: list[torch.Tensor], bits: float, align: int = ALIGN, with_scales: bool = False) -> dict:
    """Keys', values' and both sides' mean modelled distortion with bands aligned to `align`, against bands
    anywhere, at the same mean bits per number (code bits, or code + scale bits), in dB."""
    (_, _, ku, vu), (_, _, ka, va) = (_at_bits(heads, bits, a, with_scales) for a in (1, align))
    return {"keys": 10 * math.log10(ka / ku), "values": 10 * math.log10(va / vu),
            "both": 10 * math.log10((ka + va) / (ku + vu))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=48)
    parser.add_argument("--bits", type=float, nargs="+", default=[3.0, 3.5, 4.0, 4.25, 4.5, 5.0, 6.0])
    args = parser.parse_args()
    for d in (64, 128):
        heads = log_linear(d, args.heads)
        for with_scales in (False, True):
            for bits in args.bits:
                db = cost_db(heads, bits, ALIGN, with_scales)
                print(f"head_dim {d}, {bits:4.2f} {'code + scale' if with_scales else 'code'} bits per number: "
                      f"keys {db['keys']:+.2f} dB, values {db['values']:+.2f} dB, both {db['both']:+.2f} dB")


if __name__ == "__main__":
    main()
