"""kvfold-bits: kvfold's rotations with bits per rotated dim (plan/bits.py) instead of ranks alone, the
cache in the bit-band format (kvfold_runtime.bands: per-token float16 scale per band, counted).

The knob is the mean bits per stored number before scales; each is turned into the θ of the
water-filling (θ_v = V_SCALE·θ_k as export does, no per-layer multipliers) and then the per-layer
sensitivity multipliers of kvfold's ranks scale θ as they scale r. Bytes are the real per-token row bytes
(codes + scales) of every head.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvfold.plan.bits import V_SCALE, BitRule, plan_bits, theta_for_mean_bits
from kvfold.plan.ranks import factors_for

from ..patches import banded, compressed
from .base import Candidate

__all__ = ["KVFoldBits"]


@dataclass(frozen=True)
class KVFoldBits:
    name: str = "kvfold-bits"
    label: str = "kvfold-bits (ranks + bits per dim)"
    knob: str = "mean bits per number (before scales)"
    origin: str | None = None
    grid: tuple[float, ...] = (6.0, 5.0, 4.5, 4.0, 3.5, 3.0)

    def candidates(self, setup) -> Iterator[Candidate]:
        from kvfold_runtime import band_row_bytes, bands_from_bits

        bases = setup.bases("aware", "text")
        weights = setup.layer_weights()
        rule = BitRule(1.0, 1.0)
        for bits in self.grid:
            theta = theta_for_mean_bits(bases, bits, rule.widths, V_SCALE)  # export's default K/V split
            plan = plan_bits(bases, BitRule(theta, V_SCALE * theta, rule.widths, weights.k, weights.v))
            patches, stored = {}, 0
            for i, f in enumerate(factors_for(bases, plan.ranks())):
                k_bands = [bands_from_bits(h) for h in plan.k_bits[i]]
                v_bands = [bands_from_bits(h) for h in plan.v_bits[i]]
                stored += sum(map(band_row_bytes, k_bands)) + sum(map(band_row_bytes, v_bands))
                patches[i] = compressed(f, setup.dtype, banded(k_bands), banded(v_bands))
            fp16 = 2 * 2 * plan.head_dim * sum(len(layer) for layer in plan.k_bits)  # K and V, 2 bytes each
            yield Candidate(bits, stored / fp16, patches)
