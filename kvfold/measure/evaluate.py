"""Score a candidate compression on text without exporting it.

The original model runs with each layer's attention patched: q ↦ q A_h B_gᵀ before the attention
call and o ↦ o A_v B_hᵀ after it. That is algebraically the compressed model (scores q'·k', output
Σ p v' B_hᵀ), with every tensor still head_dim wide, so one model serves every candidate.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn

from kvfold.adapters import Adapter
from kvfold.calib.tokens import Sequences, batches
from kvfold.factors import LayerFactors
from kvfold.hooks import AttentionPatch, patched
from kvfold.measure.metrics import Metrics
from kvfold.progress import progress

__all__ = ["TOP_K", "Evaluator", "Reference", "score_model"]

# KL(original ‖ compressed) is computed over the original's TOP_K most likely tokens plus one bin for the
# rest, so the original's distributions fit in memory (16K tokens × 1024 × 8 bytes = 128 MiB, for any
# vocabulary) instead of a full-vocabulary tensor per token. Merging tokens into one bin can only lower
# a KL (data-processing inequality). Measured on SmolLM2 (tests/test_smollm2.py, its own weights in
# bfloat16 as the perturbation): the binned KL is 76% of the full KL with 16 tokens, 95% with 256, 98%
# with 1024.
TOP_K = 1024

# The standard errors treat each window's sums as one sample. Shorter blocks would give more samples, but
# neighbouring blocks of a long text share their documents: on Qwen2.5-Coder-1.5B's 4,096-token windows the
# perplexity ratio's standard error grew from 512-token blocks to whole windows by 1.6–1.75× (research/block_se.py,
# docs/block-se-qwen.json), so blocks would understate it. `block` exists for that measurement.


@dataclass(frozen=True)
class Reference:
    """What the original predicted on each window, kept to compare any later run against."""
    top_ids: list[torch.Tensor]  # per batch [B, T, K] int32: the original's TOP_K tokens at each position
    top_logp: list[torch.Tensor]  # per batch [B, T, K] float32: their log-probabilities


def _patch(factors: LayerFactors, like: torch.Tensor) -> AttentionPatch | None:
    """The layer's projections; a side whose heads all keep every dim is left out (its projection is the
    identity up to round-off), and a layer with nothing to project gets no patch at all. The projections
    are made in float64 and used in the dtype and on the device of `like` (a parameter of the model)."""
    before = after = None
    if not factors.qk_full():
        p_qk = factors.qk_projection().to(like)  # [H, d, d]

        def before(q, k, v):
            return torch.einsum("bhtd,hde->bhte", q, p_qk), k, v

    if not factors.v_full():
        p_o = factors.o_projection().to(like)

        def after(out):  # [B, T, H, d]
            return torch.einsum("bthd,hde->bthe", out, p_o)

    return None if before is None and after is None else AttentionPatch(before=before, after=after)


class Evaluator:
    """Scores the original model once (keeping its predictions as the Reference), then any list of
    per-layer factors, on fixed text windows.

    With `replay=True` the original's output of every decoder layer is kept too (layers × tokens × hidden
    values: use it on a few thousand tokens), and a candidate that leaves layers 0..l−1 untouched starts at
    layer l from those outputs instead of recomputing them: the sensitivity probes, which compress one
    layer each, then cost about half a forward pass on average. `compare=False` keeps no Reference (the
    probes need top-1 and NLL only)."""

    def __init__(self, model: nn.Module, adapter: Adapter, windows: Sequences, batch: int = 4, *,
                 replay: bool = False, compare: bool = True, start: int = 1) -> None:
        self.model, self.adapter, self.windows, self.batch = model, adapter, windows, batch
        self.start = start  # each window's predictions scored from this position on (score_model)
        self.reference = Reference([], []) if compare else None
        self._layers = adapter.decoder_layers(model)
        self._outputs: list[list] | None = [[] for _ in self._layers] if replay else None  # [layer][batch]
        with _recorded(self._layers, self._outputs):
            self.baseline = score_model(model, windows, batch, keep=self.reference, description="scoring the original",
                                        start=start)

    def score(self, factors: list[LayerFactors] | None, compare: bool = True) -> Metrics:
        """compare=False: top-1 and NLL only (the sensitivity probes need no agreement or KL)."""
        return self.score_patches({} if factors is None else self.patches(factors), compare)

    def patches(self, factors: list[LayerFactors], like: torch.Tensor | None = None) -> dict[int, AttentionPatch]:
        """The attention patches that make the model the compressed one (layers left whole get none), in the
        dtype and on the device of `like` (default: this model's)."""
        like = next(self.model.parameters()) if like is None else like
        patches = {i: _patch(f, like) for i, f in enumerate(factors)}
        return {i: p for i, p in patches.items() if p is not None}

    def score_patches(self, patches: dict[int, AttentionPatch], compare: bool = True) -> Metrics:
        """The model with `patches` around its layers' attention (e.g. plan.stored's quantized caches)."""
        if compare and self.reference is None:
            raise ValueError("this Evaluator keeps no reference (compare=False): score with compare=False")
        start = min(patches, default=len(self._layers)) if self._outputs is not None else 0
        with patched(self.model, self.adapter, patches), _replayed(self._layers[:start], self._outputs):
            return score_model(self.model, self.windows, self.batch, against=self.reference if compare else None,
                               description="scoring a compression", start=self.start)


@contextmanager
def _recorded(layers: list[nn.Module], outputs: list[list] | None) -> Iterator[None]:
    """Append each layer's output, per batch, to outputs[layer] (nothing when outputs is None)."""
    handles = [] if outputs is None else [
        layer.register_forward_hook(lambda _m, _args, out, i=i: outputs[i].append(out))
        for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _replayed(layers: list[nn.Module], outputs: list[list] | None) -> Iterator[None]:
    """Each of `layers` returns its recorded outputs, batch after batch, instead of computing them. The
    model's own loop still calls every layer, so nothing about its code is assumed beyond "a layer's output
    depends only on its inputs", and a layer set this way is a plain instance attribute, removed after."""
    for i, layer in enumerate(layers):
        recorded = iter(outputs[i])
        layer.forward = lambda *_args, _recorded=recorded, **_kwargs: next(_recorded)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def score_model(model: nn.Module, windows: Sequences, batch: int = 4, *, against: Reference | None = None,
                keep: Reference | None = None, description: str = "scoring", start: int = 1,
                block: int | None = None) -> Metrics:
    """Next-token top-1 accuracy and NLL of `model` as it runs now, over every window's tokens from position
    `start` on (each predicted from all before it; a later start scores long-context predictions only); with
    `against`, also top-1 agreement and KL divergence from that reference (kept with the same start); with
    `keep`, fill it with this run's predictions (the original's run, for later comparisons). Its progress: a
    stage named `description`. The sums behind the standard errors are kept per window, or with `block` per run
    of at most `block` tokens of each window's scored positions."""
    start = max(1, start)
    if any(len(s) <= start for s in windows.ids):
        raise ValueError(f"score_model(start={start}) needs windows longer than {start} tokens")
    hits: list[int] = []
    nlls: list[float] = []
    agree: list[int] = []
    kls: list[float] = []
    token_kl: list[torch.Tensor] = []
    device = next(model.parameters()).device
    with torch.inference_mode(), progress(description, len(windows.ids), "windows") as advance:
        for b, ids in enumerate(batches(windows, batch)):
            ids = ids.to(device)
            logits = model(input_ids=ids, use_cache=False).logits[:, start - 1:-1]
            ref = None if against is None else (against.top_ids[b].to(device), against.top_logp[b].to(device))
            if ref is not None and ref[0].shape[:2] != logits.shape[:2]:
                raise ValueError("score_model(against=...) must see the windows and batch size its reference saw")
            rows = _score_rows(logits, ids[:, start:], ref, keep is not None)
            del logits
            hits += _per_block(rows.hit, block)
            nlls += _per_block(rows.nll.double(), block)
            if keep is not None:
                keep.top_ids.append(rows.top_ids.cpu())
                keep.top_logp.append(rows.top_logp.cpu())
            if ref is not None:
                agree += _per_block(rows.agree, block)
                kls += _per_block(rows.kl.double(), block)
                token_kl.append(rows.kl.flatten().cpu())
            advance(len(ids))
    cuts = [_cuts(len(s) - start, block or len(s)) for s in windows.ids]
    sizes = tuple(b - a for c in cuts for a, b in pairwise(c))
    parts = tuple(p for p, c in zip(windows.parts, cuts, strict=True) for _ in c[1:]) if windows.parts else ()
    count = sum(sizes)
    p99 = torch.quantile(torch.cat(token_kl).double(), 0.99).item() if token_kl else float("nan")
    return Metrics(top1=sum(hits) / count, nll=sum(nlls) / count, tokens=count, correct=tuple(hits),
                   window_tokens=sizes, window_nll=tuple(nlls), window_agree=tuple(agree), window_kl=tuple(kls),
                   kl_p99=p99, window_part=parts)


def _cuts(n: int, block: int) -> list[int]:
    """Where a window's n scored positions are cut into blocks: n / ceil(n / block) tokens each (± 1)."""
    k = -(-n // block)
    return [round(i * n / k) for i in range(k + 1)]


def _per_block(x: torch.Tensor, block: int | None) -> list:
    """Sums of [B, T] per window and block of its T positions (window by window, blocks in order)."""
    cuts = _cuts(x.shape[1], block or x.shape[1])
    return torch.stack([x[:, a:b].sum(-1) for a, b in pairwise(cuts)], 1).flatten().tolist()  # one read-back


# Rows of logits turned into float32 at a time. The log-probabilities are never formed for the whole vocabulary:
# top-1, NLL and the KL bins need only each row's log-sum-exp, its argmax and a few gathered logits. A chunk
# this size stays in cache (64 × 49,152 × 4 B = 12 MiB) — 2× faster than log_softmax over the batch on this
# CPU — and no [B, T, vocab] float32 tensor exists beside the model's own logits (issue 12).
_ROWS = 64


@dataclass(frozen=True)
class _Rows:
    """Per position [B, T]: hit, nll, and (against a reference) agree and kl; (kept) the top tokens."""
    hit: torch.Tensor
    nll: torch.Tensor
    agree: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None  # [B, T, TOP_K] int32
    top_logp: torch.Tensor | None = None


def _score_rows(logits: torch.Tensor, target: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor] | None,
                keep: bool) -> _Rows:
    """Score [B, T, V] logits (any dtype) against the next tokens [B, T], _ROWS positions at a time."""
    shape = target.shape
    flat, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    ref_ids = None if ref is None else ref[0].reshape(-1, ref[0].shape[-1]).long()
    ref_logp = None if ref is None else ref[1].reshape(-1, ref[1].shape[-1])
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("hit", "nll", "agree", "kl", "top_ids", "top_logp")}
    for s in range(0, flat.shape[0], _ROWS):
        x = flat[s:s + _ROWS].float()
        top_val, top = x.max(-1)
        lse = top_val + (x - top_val[:, None]).exp_().sum(-1).log()  # log Σ exp, stable
        out["hit"].append(top == tgt[s:s + _ROWS])
        out["nll"].append(lse - x.gather(-1, tgt[s:s + _ROWS, None])[:, 0])
        if keep:
            vals, idx = x.topk(min(TOP_K, x.shape[-1]), dim=-1)
            out["top_ids"].append(idx.to(torch.int32))
            out["top_logp"].append(vals - lse[:, None])
        if ref is not None:
            ids = ref_ids[s:s + _ROWS]
            out["agree"].append(top == ids[:, 0])
            out["kl"].append(_binned_kl(ref_logp[s:s + _ROWS], x.gather(-1, ids) - lse[:, None]))

    def joined(key: str, *tail: int) -> torch.Tensor | None:
        return torch.cat(out[key]).reshape(*shape, *tail) if out[key] else None

    k = min(TOP_K, flat.shape[-1])
    return _Rows(hit=joined("hit"), nll=joined("nll"), agree=joined("agree"), kl=joined("kl"),
                 top_ids=joined("top_ids", k), top_logp=joined("top_logp", k))


def _binned_kl(ref_logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(P ‖ Q) per position over the reference's top tokens plus one bin for every other token:
    Σ_i p_i (log p_i − log q_i) + p_rest (log p_rest − log q_rest). Clamped at 0 (round-off)."""
    p = ref_logp.exp()
    head = (p * (ref_logp - logq)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - logq.exp().sum(-1)).clamp_min(1e-30)
    tail = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (head + tail).clamp_min(0)
