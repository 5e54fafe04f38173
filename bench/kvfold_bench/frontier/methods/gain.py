"""kvfold-gain: kvfold's bit plans with one scale a token and KV head instead of one a band (issue 51: why
kvfold-bits falls off a cliff between 3.5 and 3 bits a number at long context, and what would close it).

kvfold-bits stores a one-byte scale for every band of every token row. Its bands are 8 dims wide at head_dim ≤ 64
(16 above), so a 2-bit band costs 3 bits a number on SmolLM2, and its keys never go below 4 bits
(plan/bits.KEY_MIN_BITS): at a 3-bit budget the values are left almost nothing. Transform coding's own answer is
that after the rotation each coded dim's step is fixed relative to that dim's spread — the water-filling gives
every dim the same distortion — so the steps can be measured once; only a token's overall size varies, and one
number a row (its gain) carries it.

This coder, on kvfold-bits' plans with their bands' per-token scale bytes taken out of the water-filling:
- every dim j of a head's row x (in export's basis, after its band mixers) is divided by n_j, the dim's root mean
  square over the calibration text (one pass of the model per plan, the rows as export would store them), so y_j
  has mean square 1 there;
- the row's gain g is the root mean square of y over its coded dims, stored as a one-byte log8 (2^(c/8));
- a band of b bits rounds y_j / g with the mid-rise uniform quantizer whose step is the one that minimises a unit
  Gaussian's squared error at 2^b levels (Max 1960: STEP[b]), its codes clamped to the 2^b levels (which clips);
  16-bit bands are float16; dropped dims read 0.
Bytes: each band's codes (byte-aligned, as kvfold_runtime.bands) plus one byte a row for the gain. Variants:
`kvfold-gain-k2` lets keys go down to 2 bits as values do; `kvfold-gain-static` has no gain (g = 1, no byte).
A diagnostic on the frontier, not a cache kvfold exports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvfold.hooks import patched
from kvfold.measure.stored import compressed
from kvfold.plan.bits import KEY_MIN_BITS, V_SCALE, BitPlan, BitRule, _key_widths, bit_factors, bits_basis, dim_bits
from kvfold.plan.formats.bits import band_align_for
from kvfold_runtime import head_dim

from .base import Candidate

__all__ = ["STEP", "KVFoldGain", "gain_roundtrip"]

# The uniform quantizer's step that minimises a unit Gaussian's squared error at 2^b levels (Max 1960, table II)
STEP = {1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 8: 0.0308}


def gain_roundtrip(x: torch.Tensor, bands: tuple, rms: torch.Tensor, gain: bool = True) -> torch.Tensor:
    """One head's rows x [..., d] (float) -> what this coder gives back; `bands` the head's (kvfold_runtime.bands.Band),
    `rms` [d] its dims' calibration root mean squares."""
    out = torch.zeros_like(x)
    n = rms.to(x).clamp_min(1e-30)
    y = x / n
    coded = [b for b in bands if b.scaled]
    g = torch.ones_like(x[..., :1])
    if gain and coded:
        dims = torch.cat([torch.arange(b.start, b.start + b.size) for b in coded]).to(x.device)
        g = y[..., dims].square().mean(-1, keepdim=True).sqrt().clamp(2.0 ** -16, 2.0 ** 15)
        g = torch.exp2(torch.round(torch.log2(g) * 8) / 8)  # the stored log8 byte
    for band in bands:
        at = slice(band.start, band.start + band.size)
        if not band.scaled:
            out[..., at] = x[..., at].half().to(x)
            continue
        step = g * STEP[band.bits]
        half = 2 ** (band.bits - 1)
        q = torch.floor(y[..., at] / step).clamp(-half, half - 1)
        out[..., at] = (q + 0.5) * step * n[at]
    return out


def _coder(bands: list, rms: torch.Tensor, gain: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B, H_kv, T, d] -> every head through gain_roundtrip."""
    def quantize(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return torch.stack([gain_roundtrip(xf[:, g], b, rms[g], gain) for g, b in enumerate(bands)], 1).to(x.dtype)
    return quantize


def _row_bytes(bands: tuple, gain: bool) -> int:
    return sum(b.code_bytes if b.scaled else 2 * b.size for b in bands) + (1 if gain and any(b.scaled for b in bands)
                                                                           else 0)


@dataclass(frozen=True)
class KVFoldGain:
    name: str = "kvfold-gain"
    label: str = "kvfold-bits plans, one gain a row (steps from calibration)"
    knob: str = "mean bits per number (before scales)"
    origin: str | None = None
    grid: tuple[float, ...] = (4.0, 3.5, 3.0, 2.75, 2.5, 2.25)
    key_min: int = KEY_MIN_BITS  # keys' narrowest width (kvfold-bits': 4)
    gain: bool = True

    def _plan(self, bases: list, theta: float, align: int) -> BitPlan:
        rule = BitRule(theta, V_SCALE * theta, align=align)
        key_widths = _key_widths(rule.widths, self.key_min)  # keys never dropped, as plan_bits has them
        k_bits, v_bits = [], []
        for b in map(bits_basis, bases):  # scale_bits 0: no band pays for a scale of its own here
            k_bits.append([dim_bits(s, theta, key_widths, 0, align) for s in b.qk_spectrum])
            v_bits.append([dim_bits(s, V_SCALE * theta, rule.widths, 0, align) for s in b.v_spectrum])
        return BitPlan(k_bits=k_bits, v_bits=v_bits, head_dim=bases[0].qk_spectrum.shape[-1])

    def _theta(self, bases: list, bits: float, align: int) -> float:
        lo, hi = math.log(1e-9), math.log(1.0)
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self._plan(bases, math.exp(mid), align).mean_bits() > bits else (lo, mid)
        return math.exp(hi)

    def _rms(self, setup, factors: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the calibration root mean square of every stored dim [H_kv, d], keys and values."""
        sums: dict = {}  # (layer, side) -> Σ x² per KV head and dim
        rows: dict = {}  # (layer, side) -> rows summed

        def recorder(key):
            def record(x):
                s = x.double().square().sum((0, 2))
                sums[key] = s + sums[key] if key in sums else s
                rows[key] = rows.get(key, 0) + x.shape[0] * x.shape[2]
                return x
            return record

        patches = {i: compressed(f, setup.dtype, recorder((i, "k")), recorder((i, "v"))) for i, f in enumerate(factors)}
        device = next(setup.model.parameters()).device
        with patched(setup.model, setup.adapter, patches), torch.inference_mode():
            for ids in setup.calib_sequences().ids:
                setup.model(ids[None].to(device))
        return [tuple((sums[(i, s)] / rows[(i, s)]).sqrt().float() for s in "kv") for i in range(len(factors))]

    def candidates(self, setup) -> Iterator[Candidate]:
        bases = setup.bases("aware", "text")
        d = head_dim(setup.model.config)
        align = band_align_for(d)
        for bits in self.grid:
            plan = self._plan(bases, self._theta(bases, bits, align), align)
            factors = bit_factors(bases, plan)
            rms = self._rms(setup, factors)
            patches, stored, heads = {}, 0, 0
            for i, (f, (rk, rv)) in enumerate(zip(factors, rms, strict=True)):
                kb, vb = plan.bands("k", i), plan.bands("v", i)
                patches[i] = compressed(f, setup.dtype, _coder(kb, rk, self.gain), _coder(vb, rv, self.gain))
                stored += sum(_row_bytes(b, self.gain) for b in kb + vb)
                heads += len(kb) + len(vb)
            yield Candidate(bits, stored / (heads * 2 * d), patches)
