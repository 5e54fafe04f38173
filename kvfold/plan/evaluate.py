"""Score a candidate compression on text without exporting it.

The original model runs with each layer's attention patched: q ↦ q A_h B_gᵀ before the attention
call and o ↦ o A_v B_hᵀ after it. That is algebraically the compressed model (scores q'·k', output
Σ p v' B_hᵀ), with every tensor still head_dim wide, so one model serves every candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kvfold.adapters import Adapter
from kvfold.calib.capture import AttentionPatch, patched
from kvfold.calib.tokens import Sequences, batches
from kvfold.rewrite.factors import LayerFactors

__all__ = ["METRICS", "Evaluator", "Metrics", "score_model"]

METRICS = ("top1", "ppl")


@dataclass(frozen=True)
class Metrics:
    top1: float  # next-token top-1 accuracy
    nll: float  # mean next-token negative log-likelihood (nats)
    tokens: int
    correct: tuple[int, ...] = ()  # top-1 hits per text window, for paired standard errors

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def ratio(self, baseline: Metrics, metric: str) -> float:
        """Higher is better, 1.0 = the original: top1 / top1₀, or perplexity ppl₀ / ppl."""
        if metric == "ppl":
            return baseline.ppl / self.ppl
        return self.top1 / baseline.top1 if baseline.top1 > 0 else 1.0  # nothing to lose: ratio 1

    def top1_ratio_se(self, baseline: Metrics) -> float:
        """Standard error of the top-1 ratio R = Σc/Σb, paired over the same text windows (delta method):
        se = sqrt(W/(W−1) · Σ_w (c_w − R·b_w)²) / Σ_w b_w. It is what the ratio's last digits are worth."""
        c, b = self.correct, baseline.correct
        if len(c) < 2 or len(c) != len(b) or sum(b) == 0:
            return float("nan")
        r = sum(c) / sum(b)
        w = len(c)
        return math.sqrt(w / (w - 1) * sum((ci - r * bi) ** 2 for ci, bi in zip(c, b, strict=True))) / sum(b)


def _patch(factors: LayerFactors, dtype: torch.dtype) -> AttentionPatch:
    p_qk = factors.qk_projection().to(dtype)  # [H, d, d]
    p_o = factors.o_projection().to(dtype)

    def before(q, k, v):
        return torch.einsum("bhtd,hde->bhte", q, p_qk), k, v

    def after(out):  # [B, T, H, d]
        return torch.einsum("bthd,hde->bthe", out, p_o)

    return AttentionPatch(before=before, after=after)


class Evaluator:
    """Scores the original model once, then any list of per-layer factors, on fixed text windows."""

    def __init__(self, model: nn.Module, adapter: Adapter, windows: Sequences, batch: int = 4) -> None:
        self.model, self.adapter, self.windows, self.batch = model, adapter, windows, batch
        self.baseline = self.score(None)

    def score(self, factors: list[LayerFactors] | None) -> Metrics:
        dtype = next(self.model.parameters()).dtype
        patches = {} if factors is None else {i: _patch(f, dtype) for i, f in enumerate(factors)}
        with patched(self.model, self.adapter, patches):
            return score_model(self.model, self.windows, self.batch)


def score_model(model: nn.Module, windows: Sequences, batch: int = 4) -> Metrics:
    """Next-token top-1 accuracy and mean NLL of `model` as it runs now, over every window."""
    hits: list[int] = []
    nll = count = 0.0
    with torch.inference_mode():
        for ids in batches(windows, batch):
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            target = ids[:, 1:]
            hits += (logits.argmax(-1) == target).sum(-1).tolist()
            nll += torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="sum").item()
            count += target.numel()
    return Metrics(top1=sum(hits) / count, nll=nll / count, tokens=int(count), correct=tuple(hits))
