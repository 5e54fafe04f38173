"""Turn a compression the user asks for into a chosen point; the caches a bits plan stores, as scored. (An
accuracy target is searched by the cache format, plan/formats: `CacheFormat.search`.)"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from kvfold.errors import KVFoldError
from kvfold.factors import LayerBasis
from kvfold.measure.evaluate import Evaluator
from kvfold.measure.stored import banded, compressed
from kvfold.plan.bits import BitPlan, BitRule, bit_factors
from kvfold.plan.formats import CacheFormat
from kvfold.plan.point import Point
from kvfold.plan.ranks import RankRule

__all__ = ["bit_patches", "for_compression"]


def for_compression(fmt: CacheFormat, bases, evaluator: Evaluator, target: float,
                    rule: Callable[[float], RankRule | BitRule]) -> tuple[Point, list[Point]]:
    """Smallest removal rate whose plan (the format's) reaches compression ≥ target (no scoring needed to find it),
    then score that one point."""
    a, b = math.log(1e-4), math.log(1.0)
    if fmt.plan(bases, rule(1.0)).compression < target:
        best = fmt.plan(bases, rule(1.0)).compression
        raise KVFoldError(f"compression {target} is not reachable with these rounding settings "
                          f"(at most {best:.3f}); lower --ratio or --min-rank")
    for _ in range(40):
        mid = (a + b) / 2
        a, b = (a, mid) if fmt.plan(bases, rule(math.exp(mid))).compression >= target else (mid, b)
    point = fmt.measure(bases, evaluator, rule(math.exp(b)))
    return point, [point]


def bit_patches(bases: list[LayerBasis], plan: BitPlan, like, nudge: float = 0.0,
                coder: Callable[[list], Callable] | None = None) -> dict:
    """Every layer's attention on the bit-band cache `plan` stores (codes and scales) with the bands mixed as
    export bakes them (plan/bits.bit_factors), in the dtype and on the device of `like`; `nudge`: another
    rounding of the same cache (plan/stored.banded). `coder`: a layer side's bands -> what its cache gives back
    instead of the band codes' (e.g. research/ideal.py)."""
    coder = coder or (lambda bands: banded(bands, nudge))
    exact = (plan.sinks, plan.window) if plan.sinks or plan.window else None  # a windowed plan's whole tokens
    return {i: replace(compressed(f, like, coder(plan.bands("k", i)), coder(plan.bands("v", i))), exact=exact)
            for i, f in enumerate(bit_factors(bases, plan))}
