"""The ideal coder of a bit-band cache's bands: what the rate-distortion limit (or a coder some dB above it) gives
back for the same plan and bytes. A reference, not a cache: kvfold's band codes (kvfold.measure.stored.banded,
kvfold_runtime.bands) are measured against it (research/coder_bound.py, research/frontier_limit.py; issue 25)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ideal"]


def ideal(bands: list, gap_db: float = 0.0, seed: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B, H_kv, T, d] -> what an ideal coder of the same bands would give back: a reference, not a cache.

    Rate-distortion theory: a Gaussian row of σ² per number stored in b bits per number has a squared error of
    at least D = σ² 2^(−2b) per number, a limit long vector quantizers (trellis-coded, lattice) approach and no
    fixed-rate scalar quantizer reaches (on a Gaussian of known variance at 4 bits: uniform 4.7 dB above it,
    Lloyd-Max 3.9 dB; kvfold's band codes, with a fitted scale per row, 3.2-3.3 dB on SmolLM2's rows).
    Each band of each token row gets the Gaussian test channel of its own energy σ² (the row's mean square over
    the band), `gap_db` above the limit: x̂ = a·x + √(a·D)·n with D = 10^(gap/10)·σ² 2^(−2b), a = 1 − D/σ²,
    n ~ N(0, 1) — squared error D, the error uncorrelated with x̂, as the optimal coder's. 16-bit bands read back
    as float16, dims no band holds as 0, as in the real cache. The noise comes from one generator per call of
    this function, so every pass over the cache (another prompt, another of the pass-key check's roundings) is
    a fresh draw, in a reproducible order."""
    factor, noise = 10 ** (gap_db / 10), torch.Generator().manual_seed(seed)

    def store(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for g, head in enumerate(bands):
            for band in head:
                at = slice(band.start, band.start + band.size)
                part = x[:, g, :, at].float()
                if not band.scaled:
                    out[:, g, :, at] = part.to(torch.float16).to(x.dtype)
                    continue
                power = part.square().mean(-1, keepdim=True)
                d = torch.minimum(factor * power * 2.0 ** (-2 * band.bits), power)
                a = torch.where(power > 0, 1 - d / power.clamp_min(1e-30), 0.0)
                n = torch.randn(part.shape, generator=noise).to(part)
                out[:, g, :, at] = (a * part + (a * d).sqrt() * n).to(x.dtype)
        return out

    return store
