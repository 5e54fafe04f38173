"""Per-head ranks from the papers' removal rate (ZACK Eq. 6), optionally scaled per layer
(sensitivity.py), rounded for kernels, optionally balanced over tensor-parallel ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfold.calib.spectrum import rank_for_removal
from kvfold.factors import LayerBasis, LayerFactors
from kvfold_runtime import ConfigBlock

__all__ = ["RankPlan", "RankRule", "balance", "factors_for", "plan_ranks"]


@dataclass(frozen=True)
class RankRule:
    r_k: float  # removal rate for the Q/K spectrum
    r_v: float  # removal rate for the V spectrum
    multiple: int = 8  # round ranks up to this (16 for GPU kernels)
    min_rank: int = 8
    layer_k: tuple[float, ...] = ()  # per-layer multipliers of r_k (sensitivity allocation); () = all 1
    layer_v: tuple[float, ...] = ()
    tp: int = 1  # balance each layer's widths over this many tensor-parallel ranks (`balance`)

    def rates(self, layer: int) -> tuple[float, float]:
        wk = self.layer_k[layer] if self.layer_k else 1.0
        wv = self.layer_v[layer] if self.layer_v else 1.0
        return min(1.0, self.r_k * wk), min(1.0, self.r_v * wv)


@dataclass(frozen=True)
class RankPlan:
    d_k: list[list[int]]  # [layer][kv head]
    d_v: list[list[int]]
    head_dim: int

    def key(self) -> tuple:
        """Equal keys, equal caches (the search scores each once)."""
        return tuple(map(tuple, self.d_k)), tuple(map(tuple, self.d_v))

    @property
    def compression(self) -> float:
        """p = 1 − Σ(d_k + d_v) / Σ 2·head_dim over every layer and KV head: the cache's bytes per token
        (the runtime's row layout) against the uncompressed cache's, in any one dtype."""
        kept = ConfigBlock(self.d_k, self.d_v, False).bytes_per_token(element_size=1)
        return 1.0 - kept / (2 * self.head_dim * sum(len(row) for row in self.d_k))


def _round(rank: int, rule: RankRule, d: int) -> int:
    return min(d, max(rule.min_rank, math.ceil(rank / rule.multiple) * rule.multiple))


def plan_ranks(bases: list[LayerBasis], rule: RankRule) -> RankPlan:
    d = bases[0].qk_spectrum.shape[-1]
    d_k, d_v = [], []
    for i, b in enumerate(bases):
        r_k, r_v = rule.rates(i)
        d_k.append([_round(rank_for_removal(s, r_k), rule, d) for s in b.qk_spectrum])
        d_v.append([_round(rank_for_removal(s, r_v), rule, d) for s in b.v_spectrum])
        if rule.tp > 1:
            d_k[-1] = balance(d_k[-1], b.qk_spectrum, rule.tp, rule.multiple)
            d_v[-1] = balance(d_v[-1], b.v_spectrum, rule.tp, rule.multiple)
    return RankPlan(d_k=d_k, d_v=d_v, head_dim=d)


def balance(widths: list[int], spectra: torch.Tensor, tp: int, multiple: int) -> list[int]:
    """One layer's per-KV-head widths raised so that each of `tp` tensor-parallel ranks (consecutive heads, as
    vLLM splits them) holds the same sum: the widest rank's. A lighter rank would otherwise pad its cache with
    zero dims (kvfold_runtime.sharding); here it keeps real dims for those bytes instead — `multiple` at a time,
    each time the head's next dims that hold the largest share of that head's spectrum (most of what that head's
    cut removed). Inside the search, so the point it picks is measured with the balanced widths."""
    per = len(widths) // tp
    ranks = [list(range(r * per, (r + 1) * per)) for r in range(tp)]
    goal = max(sum(widths[g] for g in heads) for heads in ranks)
    out = list(widths)
    d = spectra.shape[-1]

    def gain(g: int) -> float:  # the share of head g's spectrum in its next `multiple` dims
        total = float(spectra[g].sum())
        return float(spectra[g][out[g]:out[g] + multiple].sum()) / total if total > 0 else 0.0

    for heads in ranks:
        while (short := goal - sum(out[g] for g in heads)) > 0:
            g = max((h for h in heads if out[h] < d), key=gain)
            out[g] += min(multiple, short, d - out[g])
    return out


def factors_for(bases: list[LayerBasis], plan: RankPlan) -> list[LayerFactors]:
    """Every layer's basis truncated to the plan's ranks."""
    return [b.truncate(dk, dv) for b, dk, dv in zip(bases, plan.d_k, plan.d_v, strict=True)]
