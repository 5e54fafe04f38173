"""Turn what the user asks for (an accuracy or a compression) into a chosen point and its curve."""

from __future__ import annotations

import math
from collections.abc import Callable

from kvfold.errors import KVFoldError
from kvfold.plan.criteria import Target
from kvfold.plan.evaluate import Evaluator
from kvfold.plan.ranks import RankPlan, RankRule, factors_for, plan_ranks
from kvfold.plan.search import CurvePoint, search_rate
from kvfold.rewrite.factors import LayerBasis

__all__ = ["for_accuracy", "for_compression"]


def _scorer(bases: list[LayerBasis], evaluator: Evaluator):
    def score(ranks: RankPlan):
        return evaluator.score(factors_for(bases, ranks)), evaluator.baseline

    return score


def for_accuracy(bases, evaluator: Evaluator, target: Target, rule: Callable[[float], RankRule],
                 progress=None) -> tuple[CurvePoint, list[CurvePoint]]:
    return search_rate(lambda rr: plan_ranks(bases, rr), _scorer(bases, evaluator), target, rule, progress=progress)


def for_compression(bases, evaluator: Evaluator, target: float,
                    rule: Callable[[float], RankRule]) -> tuple[CurvePoint, list[CurvePoint]]:
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
    rr = rule(math.exp(b))
    ranks = plan_ranks(bases, rr)
    cand, base = _scorer(bases, evaluator)(ranks)
    point = CurvePoint.measured(rr.r_k, rr.r_v, ranks.compression, cand, base)
    return point, [point]
