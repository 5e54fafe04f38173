"""The quantized caches a user would pick instead of kvfold, each counting its scale bytes:

- int8 / int4: keys (post-RoPE) and values in the plain basis, one float16 scale per token and head
  (the same symmetric mid-rise quantizer as kvfold-bits' bands, one band of every dim).
- kivi4 / kivi2 (KIVI, Liu et al. 2024): keys quantized per channel over groups of 32 tokens, values per
  token over groups of 32 channels, asymmetric (float16 scale and zero point per group). KIVI also keeps
  the most recent 32–128 tokens in float16; that residual is left out here (every cached token is
  quantized), so its accuracy is a lower bound and its bytes the long-context limit. Its key groups are
  quantized as whole 32-token groups, as KIVI does once a group is full.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvfold.adapters import HeadLayout

from ..patches import quantized_kv
from .base import Candidate

__all__ = ["IntPerToken", "Kivi", "kivi_roundtrip"]

GROUP = 32  # KIVI's group size, tokens for keys and channels for values


@dataclass(frozen=True)
class IntPerToken:
    bits: int
    origin: str | None = None
    knob: str = "none"

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def label(self) -> str:
        return f"int{self.bits} KV, per-token scale"

    def candidates(self, setup) -> Iterator[Candidate]:
        from kvfold_runtime import Band, band_roundtrip, band_row_bytes

        d = HeadLayout.from_config(setup.model.config).head_dim
        band = (Band(0, d, self.bits, "float16"),)  # as the peers store it (kvfold-bits stores one byte)
        layers = len(setup.adapter.attention_modules(setup.model))
        yield Candidate(float(self.bits), band_row_bytes(band) / (2 * d),
                        {i: quantized_kv(lambda x: band_roundtrip(x, band)) for i in range(layers)})


def _asym(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric uniform quantization over `dim`, scale and zero point stored as float16."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8).to(torch.float16).float()
    zero = lo.to(torch.float16).float()
    q = torch.round((x - zero) / scale).clamp(0, 2**bits - 1)
    return q * scale + zero


def kivi_roundtrip(x: torch.Tensor, bits: int, keys: bool) -> torch.Tensor:
    """x [B, H_kv, T, d]: keys per channel over token groups, values per token over channel groups."""
    t, d = x.shape[-2:]
    xf = x.float()
    # a partial last group is padded by repeating its last element, which leaves its range unchanged
    if keys:
        pad = (-t) % GROUP
        g = torch.cat([xf, xf[:, :, -1:].expand(-1, -1, pad, -1)], 2).unflatten(2, (-1, GROUP))  # [B, H, T/G, G, d]
        out = _asym(g, bits, dim=3).flatten(2, 3)[:, :, :t]
    else:
        pad = (-d) % GROUP
        g = torch.cat([xf, xf[..., -1:].expand(-1, -1, -1, pad)], -1).unflatten(-1, (-1, GROUP))  # [B, H, T, d/G, G]
        out = _asym(g, bits, dim=-1).flatten(-2)[..., :d]
    return out.to(x.dtype)


@dataclass(frozen=True)
class Kivi:
    bits: int
    origin: str | None = None
    knob: str = "none"

    @property
    def name(self) -> str:
        return f"kivi{self.bits}"

    @property
    def label(self) -> str:
        return f"KIVI int{self.bits} (group {GROUP})"  # its residual, if any, is in recent.py's label

    def candidates(self, setup) -> Iterator[Candidate]:
        from kvfold.hooks import AttentionPatch

        d = HeadLayout.from_config(setup.model.config).head_dim
        # per token and head: d·bits/8 code bytes; keys 4 bytes (scale + zero) per channel per 32 tokens,
        # values 4 bytes per 32 channels
        per_token = 2 * d * self.bits / 8 + 4 * d / GROUP + 4 * -(-d // GROUP)
        layers = len(setup.adapter.attention_modules(setup.model))
        patch = AttentionPatch(before=lambda q, k, v: (q, kivi_roundtrip(k, self.bits, True),
                                                       kivi_roundtrip(v, self.bits, False)))
        yield Candidate(float(self.bits), per_token / (2 * 2 * d), dict.fromkeys(range(layers), patch))
