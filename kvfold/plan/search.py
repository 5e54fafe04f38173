"""Find the largest compression whose metric ratio meets the target, recording every point tried.

Candidates form a one-parameter family r ↦ RankRule(r_k = r, r_v = v_scale·r). The metric falls as r
grows (in practice; the curve is recorded so it can be checked), so bisection on log r finds the edge.
Ranks are piecewise constant in r, so candidates with the same ranks are scored once. The bits format
(plan/bits.py) is searched the same way over its θ: a plan is anything with `compression` and `key()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from kvfold.errors import KVFoldError
from kvfold.measure.metrics import Metrics
from kvfold.plan.criteria import Target
from kvfold.plan.point import Point
from kvfold.plan.ranks import RankPlan, RankRule

__all__ = ["best_point", "search_rate"]


def search_rate(
    plan: Callable[[RankRule], RankPlan],
    score: Callable[[RankPlan], tuple[Metrics, Metrics]],  # -> (candidate, baseline)
    target: Target,
    rule: Callable[[float], RankRule],
    r_lo: float = 1e-3,
    r_hi: float = 0.5,
    steps: int = 8,
    progress: Callable[[Point], None] | None = None,
) -> tuple[Point, list[Point]]:
    seen: dict[tuple, Point] = {}
    curve: list[Point] = []

    def point(r: float) -> Point:
        rr = rule(r)
        ranks = plan(rr)
        key = ranks.key()
        if key not in seen:
            cand, base = score(ranks)
            seen[key] = Point.measured(rr.r_k, rr.r_v, ranks.compression, cand, base)
            if progress is not None:
                progress(seen[key])
        curve.append(replace(seen[key], r_k=rr.r_k, r_v=rr.r_v))
        return curve[-1]

    # r_hi is scored only if every bisection step met the target (it almost never does). Under the
    # monotonicity the bisection assumes, scoring it first chooses the same point, at one candidate more.
    lo = point(r_lo)
    if not target.met(lo):
        raise KVFoldError(f"the target ({target.describe()}) is not reachable: the mildest compression tried "
                          f"(p={lo.compression:.3f}) has {target.values(lo)}; ask for less")
    a, b = math.log(r_lo), math.log(r_hi)
    for _ in range(steps):
        mid = (a + b) / 2
        if target.met(point(math.exp(mid))):
            a = mid
        else:
            b = mid
    if b == math.log(r_hi) and target.met(point(r_hi)):
        return curve[-1], sorted(curve, key=lambda p: (p.r_k, p.r_v))
    return best_point(curve, target), sorted(curve, key=lambda p: (p.r_k, p.r_v))


def best_point(curve: list[Point], target: Target, where: str = "") -> Point:
    """The most compressed point meeting the target (ties: the more accurate)."""
    if target.needs_se() and any(math.isnan(getattr(q, b.se)) for p in curve for q in (p, *p.parts)
                                 for b in target.bounds):
        raise KVFoldError(f"no standard errors {where} (one evaluation window, or a curve recorded before this "
                          "metric existed), so no margin; pass --margin 0")
    ok = [p for p in curve if target.met(p)]
    if not ok:
        top = max(curve, key=target.slack)
        raise KVFoldError(f"the target ({target.describe()}) is not reachable {where}: the closest point has "
                          f"{target.values(top)}; ask for less")
    return max(ok, key=lambda p: (p.compression, target.slack(p)))
