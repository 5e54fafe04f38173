"""kvfold-bits: kvfold's rotations with bits per rotated dim (plan/bits.py) instead of ranks alone, the
cache in the bit-band format (kvfold_runtime.bands: a one-byte per-token scale per band, counted).

The knob is the mean bits per stored number before scales; each is turned into the θ of the
water-filling (θ_v = V_SCALE·θ_k) with no per-layer multipliers: the plan export makes by default
(--allocation eq6). Bytes are the real per-token row bytes (codes + scales) of every head.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvfold.plan.bits import V_SCALE, BitRule, plan_bits, theta_for_mean_bits
from kvfold.plan.targets import bit_patches

from .base import Candidate

__all__ = ["KVFoldBits"]


@dataclass(frozen=True)
class KVFoldBits:
    name: str = "kvfold-bits"
    label: str = "kvfold-bits (ranks + bits per dim)"
    knob: str = "mean bits per number (before scales)"
    origin: str | None = None
    grid: tuple[float, ...] = (6.0, 5.0, 4.5, 4.25, 4.0, 3.75, 3.5, 3.0)

    def candidates(self, setup) -> Iterator[Candidate]:
        bases = setup.bases("aware", "text")
        rule = BitRule(1.0, 1.0)
        for bits in self.grid:
            theta = theta_for_mean_bits(bases, bits, rule.widths, V_SCALE)  # export's default K/V split
            plan = plan_bits(bases, BitRule(theta, V_SCALE * theta, rule.widths))
            yield Candidate(bits, 1.0 - plan.compression, bit_patches(bases, plan, setup.dtype))
