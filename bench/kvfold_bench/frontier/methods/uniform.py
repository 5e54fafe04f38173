"""uniform: the same rank for keys and values in every head (the papers' /AC ablation: no adaptive
per-head ranks), on kvfold's own factors, so the gap to kvfold is what the rank allocation is worth."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvfold.plan.ranks import RankPlan, factors_for

from ..patches import compressed
from .base import Candidate

__all__ = ["Uniform"]


@dataclass(frozen=True)
class Uniform:
    name: str = "uniform"
    label: str = "uniform rank (/AC)"
    knob: str = "rank kept per head"
    origin: str | None = None
    grid: tuple[int, ...] = (62, 60, 58, 56)  # of head_dim 64; other head sizes scale

    def candidates(self, setup) -> Iterator[Candidate]:
        bases = setup.bases("aware", "text")
        d, kv_heads = bases[0].qk_spectrum.shape[-1], bases[0].qk_spectrum.shape[0]
        for rank in self.grid:
            k = max(1, min(d, round(rank * d / 64)))
            plan = RankPlan([[k] * kv_heads for _ in bases], [[k] * kv_heads for _ in bases], d)
            patches = {i: compressed(f, setup.dtype) for i, f in enumerate(factors_for(bases, plan))}
            yield Candidate(k, 1 - plan.compression, patches)
