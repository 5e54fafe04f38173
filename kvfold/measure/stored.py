"""Attention on what a compressed cache stores, as a patch around a layer's attention call: the short
k' = k B_g and v' = v A_v themselves (optionally through a quantizer, e.g. the bit bands of a bits-format
export), queries q A_h, output o' B_hᵀ. Used to score bits-format candidates (export's search) and by
the frontier benchmark.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfold.factors import LayerFactors
from kvfold.hooks import AttentionPatch

__all__ = ["banded", "compressed"]


def _stack_padded(mats: list[torch.Tensor], like: torch.dtype | torch.Tensor) -> torch.Tensor:
    """Per-head [d, r_i] -> [heads, d, d], zero columns after r_i: every head keeps the full width,
    and the zero tail adds nothing to any dot product. `like`: a dtype, or a tensor whose dtype and
    device to take."""
    d = mats[0].shape[0]
    return torch.stack([F.pad(m, (0, d - m.shape[1])) for m in mats]).to(like)


def compressed(factors: LayerFactors, like: torch.dtype | torch.Tensor,
               quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
               quantize_v: Callable[[torch.Tensor], torch.Tensor] | None = None) -> AttentionPatch:
    """Attention on the compressed tensors themselves: q' = q A_h, k' = k B_g, v' = v A_v; the cache's
    k' and v' pass through `quantize` (v' through `quantize_v` when given); the output o' B_hᵀ. Keys are shifted
    first where the factors carry a shift (k' = (k − μ_g) B_g, as the export's runtime does).
    (measure.evaluate's patch is the same algebra without materialising k' and v', which is why a quantizer
    needs this one.)"""
    qa, kb = _stack_padded(factors.qk_a, like), _stack_padded(factors.qk_b, like)  # [H|H_kv, d, d]
    va, ob = _stack_padded(factors.v_a, like), _stack_padded(factors.o_b, like)
    keep_k = quantize or (lambda x: x)
    keep_v = quantize_v or keep_k
    mean = None if factors.k_mean is None else factors.k_mean.to(kb)[None, :, None]  # [1, H_kv, 1, d]

    def mapped(q, k, v):  # [B, H|H_kv, T, d]: the compressed tensors, before the cache rounds them
        if mean is not None:
            k = k - mean
        return (torch.einsum("bhtd,hde->bhte", q, qa), torch.einsum("bhtd,hde->bhte", k, kb),
                torch.einsum("bhtd,hde->bhte", v, va))

    def before(q, k, v):
        q, k, v = mapped(q, k, v)
        return q, keep_k(k), keep_v(v)

    def after(out):  # [B, T, H, d]: o' (zero past d_v) -> o' B_hᵀ
        return torch.einsum("bthe,hde->bthd", out, ob)

    return AttentionPatch(before=before, after=after, whole=mapped)


def banded(bands: list, nudge: float = 0.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B, H_kv, T, d] -> what the bit-band cache gives back, head g stored in bands[g]
    (kvfold_runtime.bands: per-token scale per band, scale bytes counted by band_row_bytes).

    `nudge`: x·(1 + nudge) is stored instead. Rounding to codes is discontinuous, so float round-off (another
    thread count, the served model's folded weights) flips codes at level boundaries, and those flips add up
    over layers: measured on a SmolLM2 bits export, a nudge of 1e-6 moved logits at 4K tokens by up to 1.1
    and the served model lost 2 of 10 pass keys its simulation kept. A few nudged roundings of one cache show
    how much a result depends on that luck (plan/longrange.py). The nudge is applied in float32: in bfloat16 (8
    significant bits) x·(1 + 1e-6) is x again, and every nudged rounding was the first one (measured: a bfloat16
    export's three roundings gave equal margins, spread 0.000)."""
    from kvfold_runtime import band_roundtrip

    def quantize(x: torch.Tensor) -> torch.Tensor:
        y = x.float() * (1.0 + nudge) if nudge else x
        return torch.stack([band_roundtrip(y[:, g], b) for g, b in enumerate(bands)], dim=1).to(x.dtype)

    return quantize
