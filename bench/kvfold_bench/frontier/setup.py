"""One model's shared pieces for the frontier, each built once on first use: the loaded model, the
held-out windows every point is scored on, calibrations, factor bases and sensitivity scales."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kvfold import api
from kvfold.calib.artifact import CalibStats
from kvfold.calib.tokens import Sequences, text_sequences
from kvfold.factors import LayerBasis, get_method
from kvfold.factors.positions import fitted_statistics, with_key_shift
from kvfold.factors.weights import o_proj_heads
from kvfold.hooks import AttentionPatch, patched
from kvfold.measure.evaluate import Evaluator, Reference, score_model
from kvfold.measure.metrics import Metrics
from kvfold.measure.passkey import Answers, passkey_answers, passkey_prompts, passkey_summary
from kvfold.plan.bits import V_SCALE
from kvfold.plan.formats import get_format
from kvfold.plan.formats.bits import band_align_for
from kvfold.plan.recipe import Recipe
from kvfold.plan.rounding import HeadScales, measure_head_scales
from kvfold.plan.sensitivity import LayerScales, measure_scales
from kvfold.sources.models import ModelRef, load_model, resolve_model
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer
from kvfold_runtime import head_dim

from .patches import ProjMap, mapped_projections, nudged

__all__ = ["CALIBRATIONS", "Setup"]

# name -> api.calibrate options (the text ones read Setup.calib_text). zdc: ZDC's sample reduction on the same
# text, half the windows of each document group dropped and every head's vectors replaced by 64 count-weighted
# K-means centroids.
CALIBRATIONS = {
    "text": dict(source="text"),
    "random": dict(source="random"),
    "zdc": dict(source="text", prune_fraction=0.5, kmeans=64),
}


@dataclass
class Setup:
    spec: str
    workdir: Path  # calibrations are written here
    eval_text: str = "wiki:eval"
    eval_tokens: int = 6144
    calib_tokens: int = 8192
    calib_text: str = "wiki:calib"  # what the text calibrations read (a code model: e.g. wiki:calib+pysrc:calib)
    sensitivity_tokens: int = 512  # wiki:dev: costs are never measured on the text that is scored
    multiple: int = 1
    context: int = 512  # the scored windows' length (calibration and sensitivity windows stay at seq_len)
    score_from: int = 1  # each window's tokens from this position on are scored (long context: e.g. 1,024 of 4,096)
    passkey: int = 0  # passkey prompt length (measure/passkey.py); 0: none
    ref: ModelRef = field(init=False)
    model: nn.Module = field(init=False)
    windows: Sequences = field(init=False)
    baseline: Metrics = field(init=False)
    reference: Reference = field(init=False)  # the original's predictions, for agreement and KL
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.ref = resolve_model(self.spec)
        self.model = load_model(self.ref)
        self.tokenizer = load_tokenizer(self.ref.path)
        # 512-token windows, or the model's whole context if shorter
        limit = getattr(self.model.config, "max_position_embeddings", None) or 512
        self.seq_len, self.context = min(512, limit), min(self.context, limit)
        self.passkey = min(self.passkey, limit)
        self._prompts = passkey_prompts(self.tokenizer, self.passkey) if self.passkey else []  # bad sizes fail now
        self.windows = text_sequences(self.tokenizer, resolve_text(self.eval_text), self.eval_tokens, self.context,
                                      seed=0)
        self.batch = max(1, 2048 // self.context)  # the logits of 2,048 tokens at a time
        self.reference = Reference([], [])
        self.baseline = score_model(self.model, self.windows, self.batch, keep=self.reference, start=self.score_from)

    @property
    def adapter(self):
        return self.ref.adapter

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def score(self, patches: dict[int, AttentionPatch], proj_maps: dict[tuple[int, str], ProjMap] | None = None
              ) -> Metrics:
        """Top-1, NLL, agreement and KL on the held-out windows with `patches` around attention and
        `proj_maps` on k/v_proj."""
        with patched(self.model, self.adapter, patches), \
                mapped_projections(self.model, self.adapter, proj_maps or {}):
            return score_model(self.model, self.windows, self.batch, against=self.reference, start=self.score_from)

    def passkey_original(self) -> Answers:
        return self.once("passkey_original", lambda: passkey_answers(self.model, self._prompts))

    def passkey_answers(self, patches: dict[int, AttentionPatch],
                        proj_maps: dict[tuple[int, str], ProjMap] | None = None, nudge: float = 0.0) -> Answers:
        """The passkey answers with `patches` (their cache rounded once more by `nudge`: patches.nudged) and
        `proj_maps`."""
        with patched(self.model, self.adapter, nudged(patches, nudge)), \
                mapped_projections(self.model, self.adapter, proj_maps or {}):
            return passkey_answers(self.model, self._prompts)

    def passkey_summary(self, got: Answers | None = None) -> dict:
        """Keys retrieved and the answers' NLL (measure/passkey.py) of `got`, with the NLL's change against the
        original's on the same prompts; without `got`, the original's own."""
        original = self.passkey_original()
        if got is None:
            return passkey_summary(self._prompts, original.hits, original.nlls, margins=original.margins)
        return passkey_summary(self._prompts, got.hits, got.nlls, against=original.nlls, margins=got.margins)

    def once(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def stats(self, calib: str) -> CalibStats:
        def build():
            out = self.workdir / f"calib-{calib}"
            options = dict(CALIBRATIONS[calib])
            if options["source"] == "text":
                options["text"] = self.calib_text
            api.calibrate(self.spec, out, tokens=self.calib_tokens, seq_len=self.seq_len, force=True, **options)
            return CalibStats.load(out)

        return self.once(("stats", calib), build)

    def calib_sequences(self) -> Sequences:
        """The windows the text calibration read (same tokenizer, text, count and seed)."""
        return self.once("calib_seqs", lambda: text_sequences(
            self.tokenizer, resolve_text(self.calib_text), self.calib_tokens, self.seq_len, seed=0))

    def bases(self, factor: str, calib: str) -> list[LayerBasis]:
        def build():
            stats, method = self.stats(calib), get_method(factor)
            if factor == "aware" and self.adapter.rope:  # as export fits them: every position of the context
                context = self.model.config.get_text_config().max_position_embeddings
                stats = fitted_statistics(stats, self.model, context)
            bases = [method.basis(stats, i, o_proj_heads(self.model, self.adapter, i))
                     for i in range(stats.header.model.num_layers)]
            return with_key_shift(bases, stats, self.model, self.adapter.rope)

        return self.once(("bases", factor, calib), build)

    def layer_scales(self) -> LayerScales:
        """Sensitivity scales of kvfold's own bases (aware, text), measured on wiki:dev."""
        def build():
            probe = text_sequences(self.tokenizer, resolve_text("wiki:dev"), self.sensitivity_tokens, self.seq_len,
                                   seed=0)
            evaluator = Evaluator(self.model, self.adapter, probe, replay=True, compare=False)
            return measure_scales(self.bases("aware", "text"), evaluator, min_rank=min(8, self.multiple))

        return self.once("scales", build)

    def head_scales(self) -> HeadScales:
        """The bits format's per-head θ multipliers (plan/rounding.py) of kvfold's own bases, measured on as
        many tokens of export's default eval text as export measures them on (dev splits, never the scored text)."""
        def build():
            text = Recipe.model_fields["eval_text"].default
            probe = text_sequences(self.tokenizer, resolve_text(text), get_format("bits").sensitivity_tokens,
                                   self.seq_len, seed=0)
            evaluator = Evaluator(self.model, self.adapter, probe, replay=True)
            return measure_head_scales(self.bases("aware", "text"), evaluator, V_SCALE,
                                       band_align_for(head_dim(self.model.config)))  # export's alignment

        return self.once("head_scales", build)
