"""The papers' method as published (ZACK/FDC): common orthonormal rotations.

Q/K: A = B = top right-singular vectors of the stacked post-RoPE [Q_group; K] (GQA: all query heads of
the group with their KV head). V/W_O: A_v = B_h = top right-singular vectors of [V; W_O^hᵀ for h in
the group]. V enters as its per-token covariance (Gram / N) so the weights' share does not vanish as
the calibration grows — the papers do not say how the two are scaled.
"""

from __future__ import annotations

import torch

from kvfold.calib.artifact import CalibStats
from kvfold.rewrite.factors.base import LayerBasis

__all__ = ["ZackFactors"]


def _rotation(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    evals, evecs = torch.linalg.eigh(gram)
    return evecs.flip(-1), evals.flip(-1).clamp_min(0).sqrt()


class ZackFactors:
    name = "zack"

    def basis(self, stats: CalibStats, layer: int, w_o: torch.Tensor) -> LayerBasis:
        gq, gk, gv = (stats.gram(layer, k) for k in ("q", "k", "v"))
        kv_heads, heads = gk.shape[0], gq.shape[0]
        group = heads // kv_heads
        n = stats.header.tokens
        qk, qk_s, v, v_s = [], [], [], []
        for g in range(kv_heads):
            rot, s = _rotation(gq[g * group : (g + 1) * group].sum(0) + gk[g])
            qk.append(rot)
            qk_s.append(s)
            w = w_o[g * group : (g + 1) * group]  # [group, d, hidden]
            rot, s = _rotation(gv[g] / n + (w @ w.transpose(1, 2)).sum(0))
            v.append(rot)
            v_s.append(s)
        return LayerBasis(
            group=group,
            qk_spectrum=torch.stack(qk_s),
            v_spectrum=torch.stack(v_s),
            qk_a=torch.stack([qk[h // group] for h in range(heads)]),
            qk_b=torch.stack(qk),
            v_a=torch.stack(v),
            o_cov=None,
        )
