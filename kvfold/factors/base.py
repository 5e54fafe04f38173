"""What every factor method produces: a full-rank basis per layer, truncated later to any ranks.

Row vectors. Per KV head g and query head h in its group:
  scores   q_h·k  ≈ (q_h A_h)·(k B_g)          A_h, B_g: [d, d_k]   (cache stores k' = k B_g)
  output   o_h W_O^h ≈ (o_h A_v) (B_hᵀ W_O^h)   A_v: [d, d_v], B_h: [d, d_v] (cache stores v' = v A_v)
Columns of every full-rank matrix are ordered by importance, so rank r = the first r columns. B_h is
either A_v itself (orthonormal rotation) or refit by least squares on the attention-output covariance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LayerBasis", "LayerFactors", "inv_sqrt_and_sqrt", "ridge"]


@dataclass(frozen=True)
class LayerBasis:
    group: int  # query heads per KV head
    qk_spectrum: torch.Tensor  # [H_kv, d] singular values that Eq. 6 ranks d_k by, descending
    v_spectrum: torch.Tensor  # [H_kv, d] the same for d_v
    qk_a: torch.Tensor  # [H, d, d]
    qk_b: torch.Tensor  # [H_kv, d, d]
    v_a: torch.Tensor  # [H_kv, d, d]
    o_cov: torch.Tensor | None  # [H, d, d] attention-output covariance for the refit; None: B_h = A_v
    # [H_kv, d] the cached values' own mean square along each column of A_v (E[(v A_v)_j²]), what a rounding
    # error in v'_j is priced by (plan/bits.py); None: not measured (priced by v_spectrum² instead)
    v_energy: torch.Tensor | None = None
    # [H_kv, d] a constant every key is shifted by before B_g (kvfold_runtime.format.K_SHIFT: the keys' calibrated
    # mean, so the stored k' = (k − μ_g) B_g carry their spread, not their mean); None: no shift
    k_mean: torch.Tensor | None = None

    @classmethod
    def from_groups(cls, heads: int, qk_a: list, qk_b: list, qk_s: list, v_a: list, v_s: list,
                    o_cov: torch.Tensor | None, v_energy: list | None = None) -> LayerBasis:
        """Per-KV-head lists in; the query side (one A per group) is repeated for each query head."""
        group = heads // len(qk_b)
        return cls(group=group, qk_spectrum=torch.stack(qk_s), v_spectrum=torch.stack(v_s),
                   qk_a=torch.stack([qk_a[h // group] for h in range(heads)]), qk_b=torch.stack(qk_b),
                   v_a=torch.stack(v_a), o_cov=o_cov, v_energy=None if v_energy is None else torch.stack(v_energy))

    def truncate(self, d_k: list[int], d_v: list[int]) -> LayerFactors:
        heads = self.qk_a.shape[0]
        kv = [h // self.group for h in range(heads)]
        v_a = [self.v_a[g, :, : d_v[g]] for g in range(len(d_v))]
        if self.o_cov is None:
            o_b = [v_a[kv[h]] for h in range(heads)]
        else:
            o_b = [_refit(v_a[kv[h]], self.o_cov[h]) for h in range(heads)]
        return LayerFactors(
            qk_a=[self.qk_a[h, :, : d_k[kv[h]]] for h in range(heads)],
            qk_b=[self.qk_b[g, :, : d_k[g]] for g in range(len(d_k))],
            v_a=v_a,
            o_b=o_b,
            group=self.group,
            k_mean=self.k_mean,
        )


def _refit(a: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """B with Bᵀ = (AᵀCA)⁻¹AᵀC: the least-squares map from o A back to o (so o A Bᵀ ≈ o)."""
    if a.shape[1] == 0:
        return a
    bt = torch.linalg.solve(a.T @ cov @ a, a.T @ cov)  # [r, d]
    return bt.T


@dataclass(frozen=True)
class LayerFactors:
    qk_a: list[torch.Tensor]  # per query head [d, d_k(g)]
    qk_b: list[torch.Tensor]  # per KV head [d, d_k(g)]
    v_a: list[torch.Tensor]  # per KV head [d, d_v(g)]
    o_b: list[torch.Tensor]  # per query head [d, d_v(g)]
    group: int
    k_mean: torch.Tensor | None = None  # [H_kv, d] subtracted from the keys before B_g (LayerBasis.k_mean)

    def qk_full(self) -> bool:
        """Every KV head keeps all of its key dims (then q A_h B_gᵀ = q up to round-off)."""
        return all(b.shape[1] == b.shape[0] for b in self.qk_b)

    def v_full(self) -> bool:
        """Every KV head keeps all of its value dims."""
        return all(a.shape[1] == a.shape[0] for a in self.v_a)

    def qk_projection(self) -> torch.Tensor:
        """[H, d, d]: q ↦ q A_h B_gᵀ gives the compressed scores with uncompressed keys."""
        return torch.stack([a @ self.qk_b[h // self.group].T for h, a in enumerate(self.qk_a)])

    def o_projection(self) -> torch.Tensor:
        """[H, d, d]: o ↦ o A_v B_hᵀ gives the compressed output with uncompressed values."""
        return torch.stack([self.v_a[h // self.group] @ b.T for h, b in enumerate(self.o_b)])


def ridge(cov: torch.Tensor, rel: float = 1e-6) -> torch.Tensor:
    """cov + ε·I with ε relative to the mean eigenvalue: keeps inverses finite for rank-deficient stats."""
    d = cov.shape[-1]
    eps = rel * cov.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    return cov + eps[..., None, None] * torch.eye(d, dtype=cov.dtype)


def inv_sqrt_and_sqrt(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C^{-1/2}, C^{1/2} of a symmetric positive definite matrix (float64)."""
    evals, evecs = torch.linalg.eigh(cov)
    evals = evals.clamp_min(evals.max() * 1e-12)
    return (evecs * evals.rsqrt()) @ evecs.T, (evecs * evals.sqrt()) @ evecs.T
