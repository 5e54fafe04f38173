"""The plan as a value: what `kvfold export` decided before anything is baked (plan/planner.py makes it), and
what a previous export recorded of its own (--reuse-curve). checkpoint/manifest.py records an ExportPlan
(`Manifest.from_plan`) and reads a PreviousExport back (`Manifest.previous_export`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from kvfold.adapters import HeadLayout
from kvfold.calib.artifact import CalibStats
from kvfold.factors import LayerFactors
from kvfold.plan.bits import BitPlan, BitRule
from kvfold.plan.criteria import Target
from kvfold.plan.point import Point
from kvfold.plan.ranks import RankPlan, RankRule
from kvfold.plan.recipe import Recipe
from kvfold.plan.rounding import HeadScales
from kvfold.plan.sensitivity import LayerScales
from kvfold.sources.models import ModelRef
from kvfold.sources.text import Mixture

__all__ = ["Baseline", "ExportInputs", "ExportPlan", "PreviousExport"]


@dataclass(frozen=True)
class Baseline:
    """The original model's figures on the text the curve was scored on."""
    eval_text: str
    eval_tokens: int
    top1: float
    ppl: float
    context: int = 512  # the windows' length (tokens)
    score_from: int = 1  # each window's predictions scored from this position on


@dataclass(frozen=True)
class PreviousExport:
    """A previous export as its manifest records it: the settings a reused curve must share with this export
    (plan/reuse.py checks them), and the search it recorded."""
    path: Path  # its folder, for messages
    weights_sha256: str
    stats_sha256: str
    method: str
    rounding: tuple[int, int]  # (multiple, min_rank)
    tensor_parallel: int  # the tensor-parallel size its widths were balanced for (1: none)
    allocation: str
    format: str  # its cache format's name (plan/formats)
    band_scale: str | None  # its bands' scale format; None: no bands (rank layout)
    search_dtype: str
    positions: int | None
    scales: LayerScales | HeadScales | None
    curve: tuple[Point, ...]
    passkey: dict | None
    baseline: Baseline
    window: tuple[int, int] = (0, 0)  # (sinks, window) whole tokens of a windowed bits export
    key_bits: int | None = None  # a bits export's narrowest key band (Recipe.key_bits); None: a rank export


@dataclass(frozen=True)
class ExportInputs:
    """An export's inputs, checked before any output exists (plan/reuse.check_inputs)."""
    ref: ModelRef
    stats: CalibStats
    recipe: Recipe
    weights_sha256: str  # of the model's weight files (the calibration's, checked)
    previous: PreviousExport | None  # --reuse-curve
    docs: list[str] | Mixture | None  # the text the search scores on; None when a recorded curve is reused


@dataclass(frozen=True)
class ExportPlan:
    """Everything export bakes and records: the chosen point and the rule that gives it, its ranks (and bits),
    the factors to bake, the curve, the original's figures, the pass-key record and the settings."""
    model: nn.Module  # the source model in its checkpoint's dtype: what the factors are baked into
    layout: HeadLayout
    method: str
    metric: str
    target: Target | None  # the accuracy target; None: a compression target
    ratio: float | None  # the compression asked for (target None)
    allocation: str
    search_dtype: str  # the dtype the model ran in while the curve was scored
    positions: int | None  # the context the query/key statistics were averaged over (None: as calibrated)
    scales: LayerScales | HeadScales | None  # sensitivity: per-layer (ranks) or per-head (bits) multipliers
    rule: RankRule | BitRule  # the chosen point's
    ranks: RankPlan
    bits: BitPlan | None  # bits format: every dim's width and the bands' scale format; None: rank format
    factors: tuple[LayerFactors, ...]
    chosen: Point
    curve: tuple[Point, ...]
    baseline: Baseline
    passkey: dict | None  # plan/longrange.py's record; None: not checked
    # the cache format that planned it (plan/formats); None: the one its layout names (rank or bits)
    format: str | None = None

    @property
    def rounding(self) -> tuple[int, int]:
        """(multiple, min_rank) of the ranks; a bits plan's ranks follow from its bits, whose bands are aligned to
        rule.align dims: (align, 0) (the manifest's rounding_multiple; 1 before issue 50)."""
        return (self.rule.multiple, self.rule.min_rank) if isinstance(self.rule, RankRule) else (self.rule.align, 0)
