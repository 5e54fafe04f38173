"""From a Gram XᵀX to the SVD of X, and the papers' rank rule (ZACK Eq. 6)."""

from __future__ import annotations

import torch

__all__ = ["dims_for_mass", "rank_for_removal", "svd_from_gram"]


def svd_from_gram(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gram [..., d, d] (float64) -> singular values [..., d] descending, right singular vectors
    [..., d, d] as columns in the same order. Eigenvalues below 0 are round-off and are clamped."""
    evals, evecs = torch.linalg.eigh(gram.to(torch.float64))
    sv = evals.clamp_min(0).sqrt().flip(-1)
    return sv, evecs.flip(-1)


def rank_for_removal(sv: torch.Tensor, r: float) -> int:
    """Fewest leading dims k such that (sum of removed singular values) / (sum of all) <= r."""
    total = float(sv.sum())
    if total == 0.0:
        return 0
    # removed[k] = mass of sv[k:], for k = 0..d
    removed = torch.cat([sv.flip(0).cumsum(0).flip(0), sv.new_zeros(1)]) / total
    ok = (removed <= r + 1e-12).nonzero()
    return int(ok[0])


def dims_for_mass(sv: torch.Tensor, mass: float) -> int:
    """Fewest leading dims that keep at least `mass` of the singular-value mass."""
    return rank_for_removal(sv, 1.0 - mass)
