"""kvfold's default: the whitened Q/K pair and output-aware V (docs/design.md has the algebra).

Q/K: minimise E(q·k − q A Bᵀ k)²: S = C_q^{1/2} C_k^{1/2} = UΣVᵀ, A = C_q^{-1/2} U Σ^{1/2},
B = C_k^{-1/2} V Σ^{1/2} (A Bᵀ = I at full rank). C_q stacks the queries of all heads of the group.
V: A_v from the eigenvectors of the group's attention-output covariance (keeps the attention-sink
direction that the papers' [V; W_O] rotation drops); W_O refit per query head by least squares.
"""

from __future__ import annotations

import torch

from kvfold.calib.artifact import CalibStats
from kvfold.calib.spectrum import svd_from_gram
from kvfold.factors.base import LayerBasis, inv_sqrt_and_sqrt, ridge

__all__ = ["AwareFactors"]


class AwareFactors:
    name = "aware"

    def basis(self, stats: CalibStats, layer: int, w_o: torch.Tensor) -> LayerBasis:
        gq, gk, gv, go = (stats.gram(layer, k) for k in ("q", "k", "v", "o"))  # [H|H_kv, d, d] float64
        kv_heads, heads = gk.shape[0], gq.shape[0]
        group = heads // kv_heads
        qk_a, qk_b, qk_s, v_a, v_s, v_e = [], [], [], [], [], []
        for g in range(kv_heads):
            cq = ridge(gq[g * group : (g + 1) * group].sum(0))
            ck = ridge(gk[g])
            cq_is, cq_s = inv_sqrt_and_sqrt(cq)
            ck_is, ck_s = inv_sqrt_and_sqrt(ck)
            u, s, vh = torch.linalg.svd(cq_s @ ck_s)
            qk_a.append(cq_is @ u * s.sqrt())
            qk_b.append(ck_is @ vh.T * s.sqrt())
            qk_s.append(s)
            s_v, axes = svd_from_gram(go[g * group : (g + 1) * group].sum(0))
            v_a.append(axes)
            v_s.append(s_v)
            v_e.append(torch.einsum("dj,de,ej->j", axes, gv[g].to(axes), axes).clamp_min(0))  # E[(v A_v)_j²]
        return LayerBasis.from_groups(heads, qk_a, qk_b, qk_s, v_a, v_s, o_cov=ridge(go), v_energy=v_e)
