"""One model's next-token scores on fixed text windows, and every ratio to the original's with its paired
standard error: what the search compares with the target and verify with the manifest."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Metrics"]


def _ratio_se(num: tuple[float, ...], den: tuple[float, ...]) -> float:
    """Standard error of R = Σnum/Σden, paired over windows (delta method):
    se = sqrt(W/(W−1) · Σ_w (num_w − R·den_w)²) / Σ_w den_w. NaN with fewer than two windows."""
    if len(num) < 2 or len(num) != len(den) or sum(den) == 0:
        return float("nan")
    r, w = sum(num) / sum(den), len(num)
    return math.sqrt(w / (w - 1) * sum((a - r * b) ** 2 for a, b in zip(num, den, strict=True))) / sum(den)


@dataclass(frozen=True)
class Metrics:
    """One model's scores on fixed windows. The per-window sums give paired standard errors (every
    ratio to the original is a ratio of sums over the same windows); `agree` and `kl` exist only when
    the run was compared with a Reference of the original."""
    top1: float  # next-token top-1 accuracy
    nll: float  # mean next-token negative log-likelihood (nats)
    tokens: int
    correct: tuple[int, ...] = ()  # top-1 hits per text window
    window_tokens: tuple[int, ...] = ()  # scored tokens per window
    window_nll: tuple[float, ...] = ()  # NLL sum per window
    window_agree: tuple[int, ...] = ()  # argmax equal to the original's, per window
    window_kl: tuple[float, ...] = ()  # KL(original ‖ this) summed per window
    kl_p99: float = float("nan")  # 99th percentile of the per-token KL
    window_part: tuple[int, ...] = ()  # a mixture's text index per window (calib.tokens); () = one text

    @property
    def parts(self) -> list[int]:
        """The text indices present, when the windows came from a mixture of texts ([] otherwise)."""
        return sorted(set(self.window_part)) if len(set(self.window_part)) > 1 else []

    def part(self, index: int) -> Metrics:
        """The same scores over the windows of one text of the mixture (no per-token KL percentile: the
        per-token values are not kept)."""
        keep = [w for w, p in enumerate(self.window_part) if p == index]

        def pick(xs):
            return tuple(xs[w] for w in keep) if xs else ()

        tokens = sum(pick(self.window_tokens))
        return Metrics(top1=sum(pick(self.correct)) / tokens, nll=sum(pick(self.window_nll)) / tokens,
                       tokens=tokens, correct=pick(self.correct), window_tokens=pick(self.window_tokens),
                       window_nll=pick(self.window_nll), window_agree=pick(self.window_agree),
                       window_kl=pick(self.window_kl), window_part=pick(self.window_part))

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def agreement(self) -> float:
        """Fraction of positions whose top-1 token is the original's (NaN without a reference)."""
        return sum(self.window_agree) / self.tokens if self.window_agree else float("nan")

    @property
    def kl(self) -> float:
        """Mean KL(original ‖ this) per token, nats (NaN without a reference)."""
        return sum(self.window_kl) / self.tokens if self.window_kl else float("nan")

    def ratio(self, baseline: Metrics, metric: str) -> float:
        """top-1: top1 / top1₀ (higher is better); ppl: ppl / ppl₀ (lower is better, as llama.cpp reports it)."""
        if metric == "ppl":
            return self.ppl / baseline.ppl
        return self.top1 / baseline.top1 if baseline.top1 > 0 else 1.0  # nothing to lose: ratio 1

    def top1_ratio_se(self, baseline: Metrics) -> float:
        """Standard error of the top-1 ratio Σc/Σb over the same windows. It is what its last digits are worth."""
        return _ratio_se(tuple(map(float, self.correct)), tuple(map(float, baseline.correct)))

    def ppl_ratio_se(self, baseline: Metrics) -> float:
        """ppl/ppl₀ = exp(D), D = Σ_w (nll_w − nll₀_w) / Σ_w n_w: se = ppl/ppl₀ · se(D)."""
        if not self.window_nll or len(self.window_nll) != len(baseline.window_nll):
            return float("nan")
        diff = tuple(a - b for a, b in zip(self.window_nll, baseline.window_nll, strict=True))
        return self.ratio(baseline, "ppl") * _ratio_se(diff, tuple(map(float, self.window_tokens)))

    def agreement_se(self) -> float:
        return _ratio_se(tuple(map(float, self.window_agree)), tuple(map(float, self.window_tokens)))

    def kl_se(self) -> float:
        return _ratio_se(self.window_kl, tuple(map(float, self.window_tokens)))
