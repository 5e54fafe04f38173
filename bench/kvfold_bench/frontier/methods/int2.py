"""kvfold-int2: OSCAR's quantizer in kvfold's own bases (issue 51: which part of OSCAR's cache makes it cheap).

OSCAR (methods/oscar.py) rounds each token's whole head to clipped asymmetric INT2 after a per-layer rotation R = U·H
(eigenvectors of an attention-aware covariance, then a Hadamard), and keeps its first 64 and last 256 tokens whole.
After the Hadamard a token's rounding error is about the same on every coordinate, so what the rotation before it
decides is which space that even error lives in. Here it lives in kvfold's:
- keys: k' = (k − μ_g)·B_g, kvfold's post-RoPE key basis with its key shift (factors/aware.py), in which a score is
  q'·k' with E[q'_j²] = E[k'_j²] = σ_j (whitened: B_g is not orthonormal); then H, INT2, H, and back by B_g⁻¹;
- values: v' = v·A_v (kvfold's value basis), then H, INT2, H, A_v⁻¹.
Every other choice is OSCAR's (int2_roundtrip, its clipping ratios, 64 + 256 whole tokens), and so are the bytes:
2 bits a number and 32 per token and head. A diagnostic on the frontier, not a cache kvfold exports. Measured on
Qwen2.5-Coder-1.5B at 4K (docs/long-context.md, 2026-12-03): it breaks the model (KL 5.2) where oscar-shifted, the same
quantizer in OSCAR's orthonormal bases with the same key shift, holds (KL 0.015): an even error in the whitened space
is uneven in the keys' own. `kvfold-int2-orth` tests that reading: B_g replaced by its nearest orthonormal matrix
(the polar factor U·Vᵀ of B_g = U·S·Vᵀ), same directions without the whitening's scaling.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvfold.hooks import AttentionPatch
from kvfold_runtime import head_dim

from .base import Candidate
from .oscar import CLIP_K, CLIP_V, SINKS, WINDOW, int2_roundtrip
from .recent import Recent
from .turboquant import hadamard

__all__ = ["KVFoldInt2"]


def _patch(b: torch.Tensor, mu: torch.Tensor, a_v: torch.Tensor, h: torch.Tensor) -> AttentionPatch:
    """Keys and values rounded as the module docstring says; b, a_v [H_kv, d, d], mu [H_kv, d], h [d, d]."""
    to_k, from_k = b @ h, torch.linalg.inv(b.double()).float()  # x·B·H, and back: y·H·B⁻¹ (H is its own inverse)
    to_v, from_v = a_v @ h, torch.linalg.inv(a_v.double()).float()
    from_k, from_v = h @ from_k, h @ from_v

    def before(q, k, v):
        def through(x, to, back, clip):  # [B, H_kv, T, d] @ [H_kv, d, d]: each KV head in its own basis
            return int2_roundtrip(x.float() @ to.to(x.device), clip) @ back.to(x.device)

        m = mu.to(k.device)[None, :, None, :]
        k_hat = through(k.float() - m, to_k, from_k, CLIP_K) + m
        return q, k_hat.to(k.dtype), through(v, to_v, from_v, CLIP_V).to(v.dtype)

    return AttentionPatch(before=before)


@dataclass(frozen=True)
class _Int2:
    """Every token rounded (KVFoldInt2 adds the whole tokens)."""
    name: str = "kvfold-int2-all"
    label: str = "kvfold's bases, Hadamard, OSCAR's INT2"
    knob: str = "none"
    origin: str | None = None
    orthonormal: bool = False  # B_g's polar factor instead of B_g (module docstring)

    def candidates(self, setup) -> Iterator[Candidate]:
        d = head_dim(setup.model.config)
        h = hadamard(d)
        patches = {}
        for i, basis in enumerate(setup.bases("aware", "text")):
            mu = basis.k_mean if basis.k_mean is not None else torch.zeros(basis.qk_b.shape[:2])
            b = basis.qk_b.double()
            if self.orthonormal:
                u, _, vh = torch.linalg.svd(b)
                b = u @ vh
            patches[i] = _patch(b.float(), mu.float(), basis.v_a.float(), h)
        yield Candidate(2.0, (2 * d + 32) / (16 * d), patches)  # OSCAR's bytes


@dataclass(frozen=True)
class KVFoldInt2:
    name: str = "kvfold-int2"
    label: str = f"kvfold's bases + OSCAR's INT2 (first {SINKS} + last {WINDOW} tokens whole)"
    knob: str = "none"
    origin: str | None = None
    orthonormal: bool = False

    def candidates(self, setup) -> Iterator[Candidate]:
        return Recent(_Int2(orthonormal=self.orthonormal), SINKS, WINDOW).candidates(setup)
