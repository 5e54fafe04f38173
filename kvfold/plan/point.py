"""A scored candidate: one point of the accuracy–compression curve the search records. The same type is
the search's, the pass-key check's and the manifest's (checkpoint/manifest.py stores `chosen` and `curve`
as these), so a recorded curve is picked from without conversion (--reuse-curve)."""

from __future__ import annotations

import math

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from kvfold.measure.metrics import Metrics

__all__ = ["Point"]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class Point:
    """A candidate's figures against the original's; NaN where a figure was not measured. A pydantic
    dataclass: positional like any dataclass, and validated where a manifest is read."""
    r_k: float  # the search's knob: removal rates (rank format) or θ (bits format, plan/bits.py)
    r_v: float
    compression: float
    top1_ratio: float
    ppl_ratio: float  # ppl / ppl₀: 1.0 = the original, higher is worse
    top1_se: float  # standard errors, paired over the evaluation windows
    ppl_se: float = math.nan
    agreement: float = math.nan  # top-1 agreement with the original
    agreement_se: float = math.nan
    kl: float = math.nan  # mean KL(original ‖ compressed) per token, nats
    kl_se: float = math.nan
    kl_p99: float = math.nan
    # Scored on a mixture of texts (e.g. wiki:dev+pydoc:dev): the same figures on each text alone, in the
    # mixture's order. The target must hold on every one of them (plan/criteria.py). Manifest 1.3; none before.
    parts: tuple[Point, ...] = ()

    @classmethod
    def measured(cls, r_k: float, r_v: float, compression: float, cand: Metrics, base: Metrics) -> Point:
        parts = tuple(cls.measured(r_k, r_v, compression, cand.part(i), base.part(i)) for i in cand.parts)
        return cls(r_k, r_v, compression, cand.ratio(base, "top1"), cand.ratio(base, "ppl"), cand.top1_ratio_se(base),
                   cand.ppl_ratio_se(base), cand.agreement, cand.agreement_se(), cand.kl, cand.kl_se(), cand.kl_p99,
                   parts)

    def describe(self, texts: str = "") -> str:
        """One line of figures; on a mixture of texts (`texts` "A+B"), each text's top-1 and perplexity ratios too."""
        line = (f"p={self.compression:.4f}: top-1 ratio {self.top1_ratio:.4f} ± {self.top1_se:.4f}, perplexity ratio "
                f"{self.ppl_ratio:.4f} ± {self.ppl_se:.4f}, agreement {self.agreement:.4f}, mean KL {self.kl:.5f}")
        names = texts.split("+")
        if self.parts and len(names) == len(self.parts):
            line += "; " + ", ".join(f"{n} {q.top1_ratio:.4f} / {q.ppl_ratio:.4f} ± {q.ppl_se:.4f}"
                                     for n, q in zip(names, self.parts, strict=True))
        return line
