"""The papers' method as published (ZACK/FDC): common orthonormal rotations.

Q/K: A = B = top right-singular vectors of the stacked post-RoPE [Q_group; K] (GQA: all query heads of
the group with their KV head). V/W_O: A_v = B_h = top right-singular vectors of [V; W_O^hᵀ for h in
the group]. V enters as its per-token covariance (Gram / N) so the weights' share does not vanish as
the calibration grows — the papers do not say how the two are scaled.
"""

from __future__ import annotations

import torch

from kvfold.calib.artifact import CalibStats
from kvfold.calib.spectrum import svd_from_gram
from kvfold.factors.base import LayerBasis

__all__ = ["ZackFactors"]


class ZackFactors:
    name = "zack"

    def basis(self, stats: CalibStats, layer: int, w_o: torch.Tensor) -> LayerBasis:
        gq, gk, gv = (stats.gram(layer, k) for k in ("q", "k", "v"))
        kv_heads, heads = gk.shape[0], gq.shape[0]
        group = heads // kv_heads
        n = stats.header.tokens
        qk, qk_s, v, v_s = [], [], [], []
        for g in range(kv_heads):
            s, axes = svd_from_gram(gq[g * group : (g + 1) * group].sum(0) + gk[g])
            qk.append(axes)
            qk_s.append(s)
            w = w_o[g * group : (g + 1) * group]  # [group, d, hidden]
            s, axes = svd_from_gram(gv[g] / n + (w @ w.transpose(1, 2)).sum(0))
            v.append(axes)
            v_s.append(s)
        return LayerBasis.from_groups(heads, qk, qk, qk_s, v, v_s, o_cov=None)
