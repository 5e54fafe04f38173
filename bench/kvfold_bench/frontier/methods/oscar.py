"""OSCAR (Zhou et al., Together AI, arXiv 2605.17757): keys and values in INT2 in attention-aware rotated bases, the
first 64 and the last 256 tokens whole. Where the paper leaves a choice open, the authors' code decides
(github.com/FutureMLS-Lab/OSCAR: rotation/compute_kv_rotation.py, its "r_h_pbr" rotation, and the SGLang kernels):

- Keys: one rotation per layer, R_K = U_Q·H. U_Q holds the eigenvectors of C_Q (eigh's ascending order), the mean of
  q qᵀ over the calibration's tokens and every query head (post-RoPE, uncentred, float64). H is the orthonormal
  Sylvester Hadamard of head_dim. The code's bit-reversal permutation then reorders coordinates within the
  quantization group, which is the whole head: it changes nothing for this quantizer, so it is left out. OSCAR
  rotates the queries alike, so q·k needs no inverse; here the rounded keys are rotated back instead (the same
  scores).
- Values: R_V = U_S·H, with U_S from C_S = the mean over KV heads of Σ_t w_t v_t v_tᵀ / Σ_t w_t. The weight
  w_t = k_tᵀ C_Q^(g) k_t is the token's mean squared logit under its group's queries (the code normalises it to mean
  1 per head, the same thing).
- Quantizer: per token and KV head, over the whole head. Values are clipped to ±(the ⌊r·d⌋-th smallest |x|), with r
  = 0.96 for keys and 0.92 for values (the code's, the same in every layer). Then asymmetric min-max INT2: scale
  (max − min)/3, zero −min/scale, q = ⌊x/scale + zero + ½⌋ in [0, 3], x̂ = (q − zero)·scale.
- Sinks and recent tokens: the first 64 and each query's last 256 stay whole (the paper's sizes; the code defaults to
  32 and 128, and demotes eight tokens at a time).
Bytes: 2 bits a number plus a 16-bit scale and a 16-bit zero per token and head. This is the paper's accounting
(2.25 bits at head_dim 128, 2.28 with the whole tokens at 128K). The scale and zero are rounded to float16 here to
match it; the authors' evaluation kept them in float32. Calibration: the frontier's own text and tokens (the authors
prefilled 20,000 tokens of GPQA prompts).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvfold.hooks import AttentionPatch, patched
from kvfold_runtime import head_dim

from .base import Candidate
from .recent import Recent
from .turboquant import hadamard

__all__ = ["Oscar", "OscarInt2", "covariances", "int2_roundtrip", "rotations"]

SINKS, WINDOW = 64, 256
CLIP_K, CLIP_V = 0.96, 0.92
LEVELS = 3  # INT2: codes 0..3


def int2_roundtrip(x: torch.Tensor, clip: float) -> torch.Tensor:
    """x [..., d] -> OSCAR's clipped asymmetric INT2 of each row (scale and zero in float16), dequantized."""
    xf = x.float()
    d = xf.shape[-1]
    thr = xf.abs().sort(-1).values[..., min(int(clip * d), d - 1), None]
    xf = torch.maximum(torch.minimum(xf, thr), -thr)
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = ((hi - lo) / LEVELS).clamp_min(1e-8).half().float()
    zero = (-lo / scale).half().float()
    q = torch.floor(xf / scale + zero + 0.5).clamp(0, LEVELS)
    return ((q - zero) * scale).to(x.dtype)


def _each_layer(setup, capture) -> None:
    """One pass of the model over the calibration windows, `capture(layer, q, k, v)` at every attention call."""
    layers = len(setup.adapter.attention_modules(setup.model))

    def patch(i):
        def before(q, k, v):
            capture(i, q.double(), k.double(), v.double())
            return q, k, v
        return AttentionPatch(before=before)

    device = next(setup.model.parameters()).device
    with patched(setup.model, setup.adapter, {i: patch(i) for i in range(layers)}), torch.inference_mode():
        for ids in setup.calib_sequences().ids:
            setup.model(ids[None].to(device))


def covariances(setup) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer (C_Q, C_S) float64 [d, d] (the module docstring), and the keys' mean per KV head [H_kv, d] (for
    the shifted variant): two passes, as w_t needs the whole C_Q^(g)."""
    layers = len(setup.adapter.attention_modules(setup.model))
    group_q: list = [None] * layers  # per KV head, Σ q qᵀ over its query heads and the tokens [H_kv, d, d]
    key_sum: list = [None] * layers  # per KV head, Σ k
    rows = [0] * layers  # tokens × query heads per KV head
    tokens = [0] * layers

    def queries(i, q, k, v):
        h_kv = k.shape[1]
        g = q.unflatten(1, (h_kv, -1))  # [B, H_kv, group, T, d]
        s, ks = torch.einsum("bhgtd,bhgte->hde", g, g), k.sum((0, 2))
        group_q[i] = s if group_q[i] is None else group_q[i] + s
        key_sum[i] = ks if key_sum[i] is None else key_sum[i] + ks
        rows[i] += g.shape[0] * g.shape[2] * g.shape[3]
        tokens[i] += k.shape[0] * k.shape[2]

    _each_layer(setup, queries)
    c_q = [s / n for s, n in zip(group_q, rows, strict=True)]  # C_Q^(g) per KV head
    weighted: list = [None] * layers  # per KV head, Σ w v vᵀ
    weights: list = [None] * layers  # per KV head, Σ w

    def values(i, q, k, v):
        w = torch.einsum("bhtd,hde,bhte->bht", k, c_q[i], k)
        s = torch.einsum("bht,bhtd,bhte->hde", w, v, v)
        weighted[i] = s if weighted[i] is None else weighted[i] + s
        weights[i] = w.sum((0, 2)) if weights[i] is None else weights[i] + w.sum((0, 2))

    _each_layer(setup, values)
    return [(cq.mean(0), (s / w[:, None, None]).mean(0), ks / n)
            for cq, s, w, ks, n in zip(c_q, weighted, weights, key_sum, tokens, strict=True)]


def rotations(setup) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer (R_K, R_V) float32 [d, d], each covariance's eigenvectors (ascending) times the Hadamard, and the
    keys' calibration mean [H_kv, d] float32."""
    h = hadamard(head_dim(setup.model.config)).double()

    def rotation(c: torch.Tensor) -> torch.Tensor:
        return (torch.linalg.eigh((c + c.T) / 2).eigenvectors @ h).float()

    return [(rotation(c_q), rotation(c_s), mean.float()) for c_q, c_s, mean in covariances(setup)]


def _patch(r_k: torch.Tensor, r_v: torch.Tensor, shift: torch.Tensor | None) -> AttentionPatch:
    """Keys (less `shift` [H_kv, d], added back after) and values rounded in their rotated bases, rotated back."""
    def before(q, k, v):
        rk, rv = r_k.to(k.device, k.dtype), r_v.to(v.device, v.dtype)
        mu = 0 if shift is None else shift.to(k.device, k.dtype)[None, :, None, :]
        return q, int2_roundtrip((k - mu) @ rk, CLIP_K) @ rk.T + mu, int2_roundtrip(v @ rv, CLIP_V) @ rv.T
    return AttentionPatch(before=before)


@dataclass(frozen=True)
class OscarInt2:
    """OSCAR's rotated INT2 cache alone, every token rounded (Oscar adds its whole tokens). `shift`: the keys less
    their calibration mean before rounding, as kvfold's key shift does (not OSCAR's: a diagnostic of models whose
    keys share a large common part, e.g. Qwen2.5's key biases). Attention is unchanged by it: q·μ is the same for
    every key of a query."""
    name: str = "oscar-int2"
    label: str = "OSCAR INT2, no whole tokens"
    knob: str = "none"
    origin: str | None = None
    shift: bool = False

    def candidates(self, setup) -> Iterator[Candidate]:
        d = head_dim(setup.model.config)
        layers = setup.once("oscar", lambda: rotations(setup))
        patches = {i: _patch(r_k, r_v, mean if self.shift else None) for i, (r_k, r_v, mean) in enumerate(layers)}
        yield Candidate(2.0, (2 * d + 32) / (16 * d), patches)  # per number: 2 bits, and 32 per token and head


@dataclass(frozen=True)
class Oscar:
    name: str = "oscar"
    label: str = f"OSCAR (INT2, first {SINKS} + last {WINDOW} tokens whole)"
    knob: str = "none"
    origin: str | None = None
    shift: bool = False  # OscarInt2.shift (not OSCAR's own: a diagnostic)

    def candidates(self, setup) -> Iterator[Candidate]:
        return Recent(OscarInt2(shift=self.shift), SINKS, WINDOW).candidates(setup)
