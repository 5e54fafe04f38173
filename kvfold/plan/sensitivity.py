"""Sensitivity-aware rank allocation: measure how much each layer's keys and values cost when
compressed, and give cheap layers a larger removal rate.

ZACK's Eq. 6 applies one removal rate r to every head, so a head's rank follows only the shape of its
own spectrum. On SmolLM2 the loss from the same r differs ~100× between layers (layer 0's keys and
most values barely matter; keys of layers 1-18 matter most). So, once per export, each layer's K (then
V) is compressed alone at a probe rate and the increase of the next-token NLL (paired, low-noise) per
removed dim is its cost c. Layer l then uses r·w_l with w_l = (geometric mean of c / c_l)^alpha,
clipped to [1/8, 8]. The bisection on r is unchanged; w is recorded in the manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfold.factors import LayerBasis
from kvfold.measure.evaluate import Evaluator
from kvfold.plan.ranks import RankPlan, RankRule, factors_for, plan_ranks
from kvfold.progress import progress

__all__ = ["PROBE_RATE", "LayerScales", "measure_scales"]

PROBE_RATE = 0.15  # removes ~1/3 of a layer's key dims and ~1/4 of its value dims on SmolLM2
FLOOR = 2e-5  # NLL per dim: below this a cost is noise (costs can even measure negative)
ALPHA = 1.0
CLIP = 8.0


@dataclass(frozen=True)
class LayerScales:
    """Per-layer multipliers and the costs behind them; the manifest stores them as layer_scale_k/v and
    layer_cost_k/v (Manifest.from_plan, Manifest.layer_scales)."""
    k: tuple[float, ...]  # multiplier of r_k per layer
    v: tuple[float, ...]
    cost_k: tuple[float, ...]  # measured NLL increase per removed dim, per layer
    cost_v: tuple[float, ...]


def _scales(costs: list[float]) -> tuple[float, ...]:
    c = [max(x, 0.0) + FLOOR for x in costs]
    mean = math.exp(sum(map(math.log, c)) / len(c))
    return tuple(min(CLIP, max(1 / CLIP, (mean / x) ** ALPHA)) for x in c)


def measure_scales(bases: list[LayerBasis], evaluator: Evaluator, min_rank: int) -> LayerScales:
    """2 × layers evaluations of `evaluator`'s windows (use a few thousand tokens), a progress stage
    (kvfold/progress.py) as the bits format's per-head probes (plan/rounding.py)."""
    d = bases[0].qk_spectrum.shape[-1]
    full = [[d] * len(b.qk_spectrum) for b in bases]
    probe = plan_ranks(bases, RankRule(PROBE_RATE, PROBE_RATE, multiple=1, min_rank=min_rank))
    costs: dict[str, list[float]] = {"k": [], "v": []}
    with progress("sensitivity probes", 2 * len(bases), "probes") as advance:
        for kind in ("k", "v"):
            for layer in range(len(bases)):
                d_k, d_v = [list(r) for r in full], [list(r) for r in full]
                (d_k if kind == "k" else d_v)[layer] = (probe.d_k if kind == "k" else probe.d_v)[layer]
                removed = d * len(full[layer]) - sum((d_k if kind == "k" else d_v)[layer])
                if removed == 0:
                    costs[kind].append(0.0)
                else:
                    metrics = evaluator.score(factors_for(bases, RankPlan(d_k, d_v, d)), compare=False)
                    costs[kind].append((metrics.nll - evaluator.baseline.nll) / removed)
                advance()
    return LayerScales(_scales(costs["k"]), _scales(costs["v"]), tuple(costs["k"]), tuple(costs["v"]))
