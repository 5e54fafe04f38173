"""Find the largest compression whose metric ratio meets the target, recording every point tried.

Candidates form a one-parameter family r ↦ RankRule(r_k = r, r_v = v_scale·r). The metric falls as r
grows (in practice; the curve is recorded so it can be checked), so bisection on log r finds the edge.
Ranks are piecewise constant in r, so candidates with the same ranks are scored once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvfold.errors import KVFoldError
from kvfold.plan.evaluate import Metrics
from kvfold.plan.ranks import RankPlan, RankRule

__all__ = ["CurvePoint", "best_point", "search_rate"]


@dataclass(frozen=True)
class CurvePoint:
    r_k: float
    r_v: float
    compression: float
    top1_ratio: float
    ppl_ratio: float
    top1_se: float  # standard error of top1_ratio (paired over text windows)

    def ratio(self, metric: str, margin: float = 0.0) -> float:
        """The metric ratio, less `margin` standard errors (top-1 only: a lower confidence bound)."""
        if metric == "ppl":
            return self.ppl_ratio
        return self.top1_ratio - (margin * self.top1_se if margin else 0.0)


def search_rate(
    plan: Callable[[RankRule], RankPlan],
    score: Callable[[RankPlan], tuple[Metrics, Metrics]],  # -> (candidate, baseline)
    target: float,
    metric: str,
    rule: Callable[[float], RankRule],
    r_lo: float = 1e-3,
    r_hi: float = 0.5,
    steps: int = 8,
    margin: float = 0.0,
) -> tuple[CurvePoint, list[CurvePoint]]:
    seen: dict[tuple, CurvePoint] = {}
    curve: list[CurvePoint] = []

    def point(r: float) -> CurvePoint:
        rr = rule(r)
        ranks = plan(rr)
        key = (tuple(map(tuple, ranks.d_k)), tuple(map(tuple, ranks.d_v)))
        if key not in seen:
            cand, base = score(ranks)
            seen[key] = CurvePoint(rr.r_k, rr.r_v, ranks.compression, cand.ratio(base, "top1"),
                                   cand.ratio(base, "ppl"), cand.top1_ratio_se(base))
        p = seen[key]
        curve.append(CurvePoint(rr.r_k, rr.r_v, p.compression, p.top1_ratio, p.ppl_ratio, p.top1_se))
        return curve[-1]

    lo, hi = point(r_lo), point(r_hi)
    if hi.ratio(metric, margin) >= target:
        return hi, curve
    if lo.ratio(metric, margin) < target:
        raise KVFoldError(f"accuracy {target} is not reachable: the mildest compression tried "
                          f"(p={lo.compression:.3f}) keeps {lo.ratio(metric, margin):.4f} of the original {metric}; "
                          f"the best reachable is {lo.ratio(metric, margin):.4f}, ask for that or less")
    a, b = math.log(r_lo), math.log(r_hi)
    for _ in range(steps):
        mid = (a + b) / 2
        if point(math.exp(mid)).ratio(metric, margin) >= target:
            a = mid
        else:
            b = mid
    return best_point(curve, metric, target, margin), sorted(curve, key=lambda p: (p.r_k, p.r_v))


def best_point(curve: list[CurvePoint], metric: str, target: float, margin: float = 0.0,
               where: str = "") -> CurvePoint:
    """The most compressed point meeting the target (ties: the more accurate)."""
    if margin and metric == "top1" and any(math.isnan(p.top1_se) for p in curve):
        raise KVFoldError(f"no standard errors {where} (one evaluation window), so no margin; pass --margin 0")
    ok = [p for p in curve if p.ratio(metric, margin) >= target]
    if not ok:
        top = max(p.ratio(metric, margin) for p in curve)
        raise KVFoldError(f"accuracy {target} is not reachable {where}: the best is {top:.4f}; ask for that or less")
    return max(ok, key=lambda p: (p.compression, p.ratio(metric)))
