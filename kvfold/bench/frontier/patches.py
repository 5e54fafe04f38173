"""The attention changes the frontier benchmark scores, as patches around each layer's attention call
(kvfold.calib.capture) or maps of a projection's output. Each one is what a serving engine would do to
the tensors it caches; the model otherwise runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from kvfold.adapters import Adapter
from kvfold.calib.capture import AttentionPatch
from kvfold.rewrite.factors import LayerFactors

__all__ = ["FP8_MAX", "ProjMap", "banded", "compressed", "fp8_roundtrip", "key_channel_mask", "mapped_projections",
           "quantized_kv"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ProjMap = Callable[[torch.Tensor], torch.Tensor]  # a projection's output [B, T, H_kv*d] -> the same


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x stored as float8 e4m3 and read back, with one dynamic scale for the whole tensor (amax/448):
    vLLM's fp8 KV cache keeps one scale per layer for keys and one for values."""
    scale = x.abs().amax().float().clamp_min(1e-12) / FP8_MAX
    return ((x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale).to(x.dtype)


def quantized_kv(quantize: Callable[[torch.Tensor], torch.Tensor]) -> AttentionPatch:
    """Keys (post-RoPE) and values pass through `quantize`, as they would through the cache."""
    return AttentionPatch(before=lambda q, k, v: (q, quantize(k), quantize(v)))


def _stack_padded(mats: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per-head [d, r_i] -> [heads, d, d], zero columns after r_i: every head keeps the full width,
    and the zero tail adds nothing to any dot product."""
    d = mats[0].shape[0]
    return torch.stack([F.pad(m, (0, d - m.shape[1])) for m in mats]).to(dtype)


def compressed(factors: LayerFactors, dtype: torch.dtype,
               quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
               quantize_v: Callable[[torch.Tensor], torch.Tensor] | None = None) -> AttentionPatch:
    """Attention on the compressed tensors themselves: q' = q A_h, k' = k B_g, v' = v A_v; the cache's
    k' and v' pass through `quantize` (v' through `quantize_v` when given); the output o' B_hᵀ.
    (plan.evaluate's patch is the same algebra without materialising k' and v', which is why a quantizer
    needs this one.)"""
    qa, kb = _stack_padded(factors.qk_a, dtype), _stack_padded(factors.qk_b, dtype)  # [H|H_kv, d, d]
    va, ob = _stack_padded(factors.v_a, dtype), _stack_padded(factors.o_b, dtype)
    keep_k = quantize or (lambda x: x)
    keep_v = quantize_v or keep_k

    def before(q, k, v):  # [B, H|H_kv, T, d]
        return (torch.einsum("bhtd,hde->bhte", q, qa), keep_k(torch.einsum("bhtd,hde->bhte", k, kb)),
                keep_v(torch.einsum("bhtd,hde->bhte", v, va)))

    def after(out):  # [B, T, H, d]: o' (zero past d_v) -> o' B_hᵀ
        return torch.einsum("bthe,hde->bthd", out, ob)

    return AttentionPatch(before=before, after=after)


def banded(bands: list) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B, H_kv, T, d] -> what the bit-band cache gives back, head g stored in bands[g]
    (kvfold_runtime.bands: per-token float16 scale per band, scale bytes counted by row_bytes)."""
    from kvfold_runtime.bands import roundtrip

    def quantize(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([roundtrip(x[:, g], b) for g, b in enumerate(bands)], dim=1)

    return quantize


def key_channel_mask(mask: torch.Tensor) -> AttentionPatch:
    """mask [H_kv, d] of 0/1: pruned key channels are zero in the cache (ThinK); queries unchanged."""

    def before(q, k, v):
        return q, k * mask.to(k.dtype)[None, :, None, :], v

    return AttentionPatch(before=before)


@contextmanager
def mapped_projections(model: nn.Module, adapter: Adapter, maps: dict[tuple[int, str], ProjMap]) -> Iterator[None]:
    """Within the block, layer i's k_proj ("k") / v_proj ("v") output goes through maps[(i, kind)]:
    before QK-norm and RoPE, which is where Palu's low-rank latent sits."""
    attns = adapter.attention_modules(model)
    handles = []
    try:
        for (layer, kind), fn in maps.items():
            proj = getattr(attns[layer], adapter.k_proj if kind == "k" else adapter.v_proj)
            handles.append(proj.register_forward_hook(lambda _m, _args, out, fn=fn: fn(out)))
        yield
    finally:
        for h in handles:
            h.remove()
