"""The attention transformers runs: per KV head, one torch scaled_dot_product_attention call at that
head's own width (its query heads as a GQA group). No per-layer padding to a common width.

CPU (and CUDA) fused SDPA kernels need the key and value widths equal; otherwise torch falls back to
the math kernel, which materialises the [T, S] score matrix (≈ 0.5 GB per group for a 4K prompt).
So the narrower of (q, k) and v is zero-padded to the wider for the call only — zeros add nothing to
q·k, and padded value columns are sliced off the output. The cache never holds the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfold_runtime.kernels.masks import head_mask
from kvfold_runtime.kernels.reference import reference_attention

__all__ = ["sdpa_attention"]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[-1] != width:
        return F.pad(x, (0, width - x.shape[-1]))
    if x.is_cuda and not _aligned(x):
        # a head's slice of a packed row starts wherever the widths before it end, and its rows are Σ widths apart;
        # CUDA's fused SDPA kernels (cuDNN, flash) read 16-byte vectors and fail with "misaligned address" on such
        # a view (seen on an H200, torch 2.11): give them a copy of their own
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _aligned(x: torch.Tensor) -> bool:
    """Its start and every stride but the last fall on 16-byte boundaries."""
    size = x.element_size()
    strides = zip(x.stride()[:-1], x.shape[:-1], strict=True)
    return x.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st, n in strides if n > 1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int],
                   group: int, *, scaling: float, mask: torch.Tensor | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """Same contract as reference_attention (packed layouts, original scaling)."""
    if softcap is not None:  # SDPA cannot soft-cap scores
        return reference_attention(q, k, v, d_k, d_v, group, scaling=scaling, mask=mask, softcap=softcap)
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    qs = q.split([group * w for w in d_k], -1)
    ks, vs = k.split(d_k, -1), v.split(d_v, -1)
    if mask is None:
        # transformers drops the mask when it is plainly causal (T == S) or not needed (T == 1)
        attn_mask, causal = (None, t > 1) if t in (1, s) else (head_mask(None, 0, t, s, q.device)[:, None], False)
    else:
        attn_mask, causal = mask[..., :s], False
    out = []
    for g, (dk, dv) in enumerate(zip(d_k, d_v, strict=True)):
        width = max(dk, dv)
        qg = _pad(qs[g].view(b, t, group, dk).transpose(1, 2), width)  # [B, group, T, w]
        kg = _pad(ks[g], width)[:, None]  # [B, 1, S, w]
        vg = _pad(vs[g], width)[:, None]
        mg = attn_mask if attn_mask is None or attn_mask.shape[1] == 1 else attn_mask[:, g * group:(g + 1) * group]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mg, is_causal=causal, scale=scaling,
                                           enable_gqa=True)  # [B, group, T, w]
        out.append(o[..., :dv].transpose(1, 2).reshape(b, t, group * dv))
    return torch.cat(out, -1)

