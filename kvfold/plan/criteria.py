"""What it means for a compressed model to meet the user's target, for every metric kvfold measures.

A target is a set of bounds, each on one ratio to the original and each checked at a confidence margin
(the ratio moved `margin` paired standard errors the unfavourable way):

    joint (default)  top-1 ratio ≥ A  and  perplexity ratio ppl/ppl₀ ≤ 1/A
    top1             top-1 ratio ≥ A            (how many predictions are right)
    ppl              ppl/ppl₀ ≤ 1/A              (how much probability the right tokens keep)
    agree            top-1 agreement ≥ A         (how many predictions are the original's own)
    kl               mean KL(original ‖ compressed) ≤ X nats

Why joint: top-1 alone can hold while the distribution drifts (issue 14 measured top-1 ratio 0.9998 at
perplexity ratio 1.068 on the search text); perplexity alone ignores the argmax a greedy decoder emits.
Requiring both closes both holes at no extra measurement.

A point scored on a mixture of texts (the default search text wiki:dev+pydoc:dev) meets a bound only if
the mixture and each text alone meet it: a pooled figure can average a text that fails with one that
passes, and the user's own text may be like either. Measured (README, "Accuracy out of domain"): pooled,
the search chose a point whose perplexity ratio on pydoc:dev was 1.0106 ± 0.0049 (wiki:dev 1.0036), and
held-out pydoc:eval then missed the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Bound", "Target"]


@dataclass(frozen=True)
class Bound:
    name: str  # a field of Point (plan/point.py): top1_ratio, ppl_ratio, agreement, kl
    se: str  # the field holding its standard error
    limit: float
    upper: bool  # True: value ≤ limit; False: value ≥ limit

    def slack(self, point, margin: float) -> float:
        """≥ 0 when met: the distance to the limit after moving `margin` standard errors against it. A figure
        from one text window has no standard error (nan): it is held to the limit itself."""
        value, se = getattr(point, self.name), getattr(point, self.se)
        if math.isnan(value):
            return -math.inf
        moved = value + (margin * se if margin and not math.isnan(se) else 0.0) * (1 if self.upper else -1)
        return self.limit - moved if self.upper else moved - self.limit

    def describe(self) -> str:
        label = {"top1_ratio": "top-1 ratio", "ppl_ratio": "perplexity ratio", "agreement": "top-1 agreement",
                 "kl": "mean KL"}[self.name]
        return f"{label} {'≤' if self.upper else '≥'} {self.limit:.5g}"


@dataclass(frozen=True)
class Target:
    metric: str
    level: float  # the accuracy A, or for kl the largest mean KL X
    margin: float = 0.0

    @property
    def bounds(self) -> tuple[Bound, ...]:
        a = self.level
        top1 = Bound("top1_ratio", "top1_se", a, upper=False)
        ppl = Bound("ppl_ratio", "ppl_se", 1 / a, upper=True)
        return {"joint": (top1, ppl), "top1": (top1,), "ppl": (ppl,),
                "agree": (Bound("agreement", "agreement_se", a, upper=False),),
                "kl": (Bound("kl", "kl_se", a, upper=True),)}[self.metric]

    def slack(self, point, margin: float | None = None) -> float:
        """The tightest bound's slack (≥ 0: every bound met), over the point and each text of its mixture."""
        m = self.margin if margin is None else margin
        return min(b.slack(p, m) for p in (point, *getattr(point, "parts", ())) for b in self.bounds)

    def met(self, point, margin: float | None = None) -> bool:
        return self.slack(point, margin) >= 0

    def needs_se(self) -> bool:
        return bool(self.margin)

    def describe(self) -> str:
        """For the manifest and messages, e.g. 'top-1 ratio ≥ 0.99 and perplexity ratio ≤ 1.0101 (1 se)'."""
        margin = f" ({self.margin:g} se)" if self.margin else ""
        return " and ".join(b.describe() for b in self.bounds) + margin

    def values(self, point) -> str:
        """The point's figures for the bounds, e.g. 'top-1 ratio 0.9912 ± 0.0030, perplexity ratio 1.0200'."""
        return ", ".join(f"{b.describe().rsplit(' ', 2)[0]} {getattr(point, b.name):.4f} ± {getattr(point, b.se):.4f}"
                         for b in self.bounds)
