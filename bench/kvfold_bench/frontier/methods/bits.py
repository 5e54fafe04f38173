"""kvfold-bits: kvfold's rotations with bits per rotated dim (plan/bits.py) instead of ranks alone, the
cache in the bit-band format (kvfold_runtime.bands: a one-byte per-token scale per band, counted).

The knob is the mean bits per stored number before scales; each is turned into the θ of the
water-filling (θ_v = V_SCALE·θ_k) with no per-head or per-layer multipliers: the plan export makes by default
(--allocation eq6), its bands aligned as export's (8-dim chunks at head_dim ≤ 64, else 16: formats/bits.band_align_for).
The variant
kvfold-bits-heads plans with the per-head multipliers of the bits format's sensitivity allocation (plan/rounding.py,
measured once per model: setup.head_scales); kvfold-bits-unaligned with bands anywhere (align 1: export
--band-align 1, the allocation before issue 50), to measure what the alignment costs; kvfold-bits-k2 (-k3) with keys
down to 2 (3) bits (plan/bits.KEY_MIN_BITS is 4); kvfold-bits-keys4 and
-values4 move the K/V split (θ_v = 4·V_SCALE·θ_k or V_SCALE/4·θ_k: more of the bytes on keys, or on values).
Bytes are the real per-token row bytes (codes + scales) of every head.

Another coder of the same plans and bytes is a subclass overriding `coder` (research/frontier_limit.py: an ideal
coder's error, the references kvfold-bits-limit and kvfold-bits-limit+2dB of issue 25).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvfold.plan.bits import KEY_MIN_BITS, V_SCALE, BitRule, plan_bits, theta_for_mean_bits
from kvfold.plan.formats.bits import band_align_for
from kvfold.plan.targets import bit_patches
from kvfold_runtime import head_dim

from .base import Candidate

__all__ = ["KVFoldBits"]


@dataclass(frozen=True)
class KVFoldBits:
    name: str = "kvfold-bits"
    label: str = "kvfold-bits (ranks + bits per dim)"
    knob: str = "mean bits per number (before scales)"
    origin: str | None = None
    grid: tuple[float, ...] = (6.0, 5.0, 4.5, 4.25, 4.0, 3.75, 3.5, 3.0)
    allocation: str = "eq6"  # one θ for every head (export's default), or "sensitivity": per-head θ
    align: int | None = None  # bands start and end on multiples of this many dims (--band-align; None: export's
    # default for the model's head_dim); 1: anywhere
    v_scale: float = V_SCALE  # θ_v / θ_k: export's K/V split by default; larger, more of the bytes on keys
    key_min: int = KEY_MIN_BITS  # keys' narrowest width (plan/bits.py)

    def candidates(self, setup) -> Iterator[Candidate]:
        bases = setup.bases("aware", "text")
        widths = BitRule(1.0, 1.0).widths
        scales = setup.head_scales() if self.allocation == "sensitivity" else None
        heads = dict(head_k=scales.k, head_v=scales.v) if scales else {}
        align = self.align or band_align_for(head_dim(setup.model.config))
        for bits in self.grid:
            theta = theta_for_mean_bits(bases, bits, widths, self.v_scale, **heads, align=align, key_min=self.key_min)
            plan = plan_bits(bases, BitRule(theta, self.v_scale * theta, widths, **heads, align=align,
                                            key_min=self.key_min))
            yield Candidate(bits, 1.0 - plan.compression,
                            bit_patches(bases, plan, setup.dtype, coder=self.coder()))

    def coder(self) -> Callable[[list], Callable] | None:
        """One candidate's coder: a layer side's bands -> what its cache gives back (plan/targets.bit_patches);
        None: the band codes themselves (kvfold_runtime.bands), the real cache."""
        return None
