"""Reference attention for uneven per-head dims: plain math, one query head at a time.

This is the oracle: the torch serving path and any Triton/CUDA kernel are tested against it. It is
written for clarity, not speed (it materialises every [T, S] score matrix).
"""

from __future__ import annotations

import torch

from kvfold_runtime.kernels.masks import additive, head_mask

__all__ = ["reference_attention"]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int],
                        group: int, *, scaling: float, mask: torch.Tensor | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """q [B, T, Σ_h d_k(g(h))], k [B, S, Σ_g d_k], v [B, S, Σ_g d_v] -> [B, T, Σ_h d_v(g(h))].

    Scores are q·k × scaling (the original model's scaling: compressed dims approximate the full
    product, so 1/sqrt(d_k) would be wrong), optionally soft-capped (Gemma 2), masked, then a float32
    softmax (float64 inputs stay float64); query head h reads KV head h // group."""
    t, s = q.shape[1], k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    q_heads = q.split([d_k[h // group] for h in range(group * len(d_k))], -1)
    k_heads, v_heads = k.split(d_k, -1), v.split(d_v, -1)
    out = []
    for h, qh in enumerate(q_heads):
        g = h // group
        scores = (qh @ k_heads[g].transpose(-1, -2)).to(acc) * scaling  # [B, T, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        m = additive(head_mask(mask, h, t, s, q.device), acc)
        if m is not None:
            scores = scores + m
        out.append(scores.softmax(-1).to(v.dtype) @ v_heads[g])  # [B, T, d_v[g]]
    return torch.cat(out, -1)
