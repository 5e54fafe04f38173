"""The query and key statistics of RoPE models, averaged over every position the export will serve.

Calibration reads 512-token windows, so its post-RoPE Grams describe positions 0–511 only. RoPE turns the
i-th plane of a query or key by ω_i·t at position t; a plane whose period is much longer than the window
(SmolLM2: ω_i down to 1.4e-5 rad per token) is seen at a narrow range of angles, and a projection fitted to
it keeps the directions a key has early in a sequence and drops the ones it turns into later. Measured on
SmolLM2-135M (2026-11-25, 512-token calibration, every head at r = 0.02 with no sensitivity allocation):
the export kept the top-1 ratio on 512-token windows and retrieved **0 of 10** pass keys at 1,024 tokens,
where the original retrieves 6 (measure/passkey.py).

The fix needs no new data. Shifting every vector by s positions multiplies, in the complex form
z_a = x_a + i·x_{a+d/2} (transformers' rotate_half pairing), each entry E[z_a z̄_b] of the Hermitian part
by e^{i(ω_a−ω_b)s} and each entry E[z_a z_b] of the pseudo-covariance by e^{i(ω_a+ω_b)s}. Averaging s over
[0, C) multiplies them by the mean phase, (1 − e^{iΔC}) / (C(1 − e^{iΔ})), in closed form: the Grams then
describe positions 0 to C + 511, i.e. a workload whose vectors sit anywhere in the model's context C.
High-frequency planes, already averaged within one window, are unchanged; planes slower than C/2π stay
as measured (they barely turn within the context either).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

__all__ = ["PositionAveraged", "fitted_statistics", "holds_key_shift", "position_average", "position_average_mean",
           "rope_frequencies", "with_key_shift"]


def _mean_phase(delta: torch.Tensor, context: int) -> torch.Tensor:
    """mean over s = 0 … context−1 of e^{i·delta·s}, elementwise."""
    step = torch.exp(1j * delta)
    flat = (1 - step).abs() < 1e-12  # delta ≡ 0 (mod 2π): every term is 1
    mean = (1 - torch.exp(1j * delta * context)) / (context * torch.where(flat, torch.ones_like(step), 1 - step))
    return torch.where(flat, torch.ones_like(mean), mean)


def position_average(gram: torch.Tensor, inv_freq: torch.Tensor, context: int) -> torch.Tensor:
    """`gram` [..., d, d] of post-RoPE vectors, averaged over shifts s ∈ [0, context) of their positions
    (RoPE with transformers' rotate_half pairing, plane a = dims (a, a + d/2) at frequency inv_freq[a])."""
    d = gram.shape[-1]
    half = d // 2
    if inv_freq.numel() != half:
        raise ValueError(f"{inv_freq.numel()} RoPE frequencies for head_dim {d}: partial rotary is not supported")
    a, b, x = gram[..., :half, :half], gram[..., half:, half:], gram[..., :half, half:]
    xt = x.transpose(-1, -2)
    herm = torch.complex(a + b, xt - x)  # E[z zᴴ]
    pseudo = torch.complex(a - b, x + xt)  # E[z zᵀ]
    w = inv_freq.to(torch.float64)
    herm = herm * _mean_phase(w[:, None] - w[None, :], context)
    pseudo = pseudo * _mean_phase(w[:, None] + w[None, :], context)
    a, b = (herm.real + pseudo.real) / 2, (herm.real - pseudo.real) / 2
    x = (pseudo.imag - herm.imag) / 2
    return torch.cat([torch.cat([a, x], -1), torch.cat([x.transpose(-1, -2), b], -1)], -2)


def position_average_mean(mean: torch.Tensor, inv_freq: torch.Tensor, context: int) -> torch.Tensor:
    """`mean` [..., d] of post-RoPE vectors, averaged over shifts s ∈ [0, context) of their positions: plane a's
    z_a turns by e^{i·ω_a·s}, so its mean is multiplied by the mean phase."""
    half = mean.shape[-1] // 2
    z = torch.complex(mean[..., :half], mean[..., half:]) * _mean_phase(inv_freq.to(torch.float64), context)
    return torch.cat([z.real, z.imag], -1)


def rope_frequencies(net: nn.Module, num_layers: int) -> list[torch.Tensor] | None:
    """Each layer's RoPE frequencies, read from the model's rotary embedding module (per layer type where
    the model has several, e.g. Gemma3's local and global attention); None for a model without RoPE."""
    rotary = next((m for name, m in net.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return None
    if hasattr(rotary, "inv_freq"):
        return [rotary.inv_freq.detach().double().cpu()] * num_layers
    types = getattr(net.config.get_text_config(), "layer_types", None) or []
    return [getattr(rotary, f"{t}_inv_freq").detach().double().cpu() for t in types[:num_layers]]


class PositionAveraged:
    """CalibStats as the factor methods read it, with the query and key Grams position-averaged."""

    def __init__(self, stats, inv_freq: list[torch.Tensor], context: int):
        self.stats, self.header, self.inv_freq, self.context = stats, stats.header, inv_freq, context

    def gram(self, layer: int, kind: str) -> torch.Tensor:
        g = self.stats.gram(layer, kind)
        return position_average(g, self.inv_freq[layer], self.context) if kind in ("q", "k") else g

    def key_mean(self, layer: int) -> torch.Tensor | None:
        m = self.stats.key_mean(layer)
        return None if m is None else position_average_mean(m.to(torch.float64), self.inv_freq[layer], self.context)


def holds_key_shift(net: nn.Module, rope: bool) -> bool:
    """Whether an export of `net` can hold a key shift: RoPE models (the shift is subtracted after RoPE,
    kvfold_runtime.format.K_SHIFT) without logit soft-capping (tanh of the scores is not blind to a constant added
    to them)."""
    return rope and not getattr(net.config.get_text_config(), "attn_logit_softcapping", None)


def with_key_shift(bases: list, stats, net: nn.Module, rope: bool) -> list:
    """`bases` with the keys' calibrated mean as their shift (LayerBasis.k_mean) where the export can hold one
    (holds_key_shift). Calibrations without means: unchanged.

    Measured on Qwen2.5-Coder-1.5B (2026-11-26, bfloat16, 2,048 pysrc:dev tokens, the bits search's mildest point,
    0.516 of fp16's bytes): mean KL 0.0183 → 0.0012, perplexity ratio 1.0175 → 1.0018. Its K bias gives the
    post-RoPE keys of layer 0 a shared direction ~20× their spread (score rms 2,749 at 1/√d): rounding k' to
    bfloat16 alone moved the scores by ~6."""
    if not holds_key_shift(net, rope):
        return bases
    means = [stats.key_mean(i) for i in range(len(bases))]
    if any(m is None for m in means):
        return bases
    return [replace(b, k_mean=m) for b, m in zip(bases, means, strict=True)]


def fitted_statistics(stats, net: nn.Module, context: int | None):
    """What the factor methods fit: `stats` as calibrated (context None or 0), or with the query and key Grams
    averaged over positions [0, context) at `net`'s RoPE frequencies."""
    if not context:
        return stats
    return PositionAveraged(stats, rope_frequencies(net, stats.header.model.num_layers), context)
