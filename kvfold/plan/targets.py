"""Turn what the user asks for (an accuracy or a compression) into a chosen point and its curve."""

from __future__ import annotations

import math
from collections.abc import Callable

from kvfold.errors import KVFoldError
from kvfold.factors import LayerBasis
from kvfold.measure.evaluate import Evaluator
from kvfold.measure.stored import banded, compressed
from kvfold.plan.bits import BitPlan, BitRule, bit_factors, plan_bits
from kvfold.plan.criteria import Target
from kvfold.plan.point import Point
from kvfold.plan.ranks import RankPlan, RankRule, factors_for, plan_ranks
from kvfold.plan.search import search_rate

__all__ = ["bit_patches", "for_accuracy", "for_accuracy_bits", "for_compression", "measure"]


def _scorer(bases: list[LayerBasis], evaluator: Evaluator):
    def score(ranks: RankPlan):
        return evaluator.score(factors_for(bases, ranks)), evaluator.baseline

    return score


def _bit_scorer(bases: list[LayerBasis], evaluator: Evaluator):
    """Each bits plan scored on the cache it would store (band codes and scales, measure/stored.py)."""
    like = next(evaluator.model.parameters())  # the model's dtype and device

    def score(plan: BitPlan):
        return evaluator.score_patches(bit_patches(bases, plan, like)), evaluator.baseline

    return score


def measure(bases: list[LayerBasis], evaluator: Evaluator, rule: RankRule | BitRule) -> Point:
    """One point scored as the searches score their candidates: a rank rule's ranks, or a bit rule's cache."""
    if isinstance(rule, BitRule):
        plan = plan_bits(bases, rule)
        cand, base = _bit_scorer(bases, evaluator)(plan)
    else:
        plan = plan_ranks(bases, rule)
        cand, base = _scorer(bases, evaluator)(plan)
    return Point.measured(rule.r_k, rule.r_v, plan.compression, cand, base)


def for_accuracy(bases, evaluator: Evaluator, target: Target, rule: Callable[[float], RankRule], *, steps: int,
                 progress=None) -> tuple[Point, list[Point]]:
    return search_rate(lambda rr: plan_ranks(bases, rr), _scorer(bases, evaluator), target, rule, steps=steps,
                       progress=progress)


def for_accuracy_bits(bases, evaluator: Evaluator, target: Target, rule: Callable[[float], BitRule], *,
                      steps: int, progress=None) -> tuple[Point, list[Point]]:
    """The bits format: the same search over the water-filling's θ (plan/bits.py), each candidate scored
    on the cache it would store (band codes and scales, measure/stored.py)."""
    # θ from 1e-7 on the side with the larger θ (about 8 bits for a head's average dim: int8-like) to θ_k = 0.1
    # (nearly every dim dropped)
    unit = rule(1.0)
    r_lo = 1e-7 / max(1.0, unit.theta_v / unit.theta_k)
    return search_rate(lambda rule_: plan_bits(bases, rule_), _bit_scorer(bases, evaluator), target, rule,
                       r_lo=r_lo, r_hi=0.1, steps=steps, progress=progress)


def for_compression(bases, evaluator: Evaluator, target: float,
                    rule: Callable[[float], RankRule]) -> tuple[Point, list[Point]]:
    """Smallest removal rate whose ranks reach compression ≥ target (no scoring needed to find it),
    then score that one point."""
    a, b = math.log(1e-4), math.log(1.0)
    if plan_ranks(bases, rule(1.0)).compression < target:
        best = plan_ranks(bases, rule(1.0)).compression
        raise KVFoldError(f"compression {target} is not reachable with these rounding settings "
                          f"(at most {best:.3f}); lower --ratio or --min-rank")
    for _ in range(40):
        mid = (a + b) / 2
        a, b = (a, mid) if plan_ranks(bases, rule(math.exp(mid))).compression >= target else (mid, b)
    point = measure(bases, evaluator, rule(math.exp(b)))
    return point, [point]


def bit_patches(bases: list[LayerBasis], plan: BitPlan, like, nudge: float = 0.0,
                coder: Callable[[list], Callable] | None = None) -> dict:
    """Every layer's attention on the bit-band cache `plan` stores (codes and scales) with the bands mixed as
    export bakes them (plan/bits.bit_factors), in the dtype and on the device of `like`; `nudge`: another
    rounding of the same cache (plan/stored.banded). `coder`: a layer side's bands -> what its cache gives back
    instead of the band codes' (e.g. measure/stored.ideal)."""
    coder = coder or (lambda bands: banded(bands, nudge))
    return {i: compressed(f, like, coder(plan.bands("k", i)), coder(plan.bands("v", i)))
            for i, f in enumerate(bit_factors(bases, plan))}
