"""An export's inputs, checked before any work, and --reuse-curve: a previous export's recorded curve answers
a new target without evaluating anything, when it was searched with the same settings."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError
from torch import nn
from transformers import AutoConfig

from kvfold.calib.artifact import CalibStats
from kvfold.errors import KVFoldError
from kvfold.plan.bits import check_align
from kvfold.plan.criteria import Target
from kvfold.plan.export_plan import ExportInputs, PreviousExport
from kvfold.plan.formats import get_format
from kvfold.plan.point import Point
from kvfold.plan.recipe import Recipe
from kvfold.plan.search import best_point
from kvfold.sources.models import ModelRef, weights_sha256
from kvfold.sources.text import resolve_text

__all__ = ["check_inputs", "context_positions", "model_positions", "pick"]


def check_inputs(ref: ModelRef, calib: Path, recipe: Recipe, previous: PreviousExport | None = None) -> ExportInputs:
    """What plan_export plans from, checked before anything is written: the calibration measured these weights,
    a previous export (--reuse-curve) was searched with this export's settings, the evaluation text exists."""
    stats = CalibStats.load(Path(calib))
    sha = weights_sha256(ref.path)
    if stats.header.model.weights_sha256 != sha:
        raise KVFoldError(f"'{calib}' was calibrated on different weights than '{ref.spec}' (sha256 differs); "
                          f"run kvfold calibrate {ref.spec} first")
    kv_heads = stats.header.model.num_kv_heads
    if kv_heads % recipe.tp:
        raise KVFoldError(f"--tp {recipe.tp}: the model's {kv_heads} KV heads do not split over {recipe.tp} "
                          f"tensor-parallel ranks; give a --tp that divides {kv_heads}")
    try:  # the defaults that depend on the model: the bits' band_align, its window where it serves long context
        recipe = get_format(recipe.format).resolve(recipe, stats.header.model.head_dim, model_positions(ref))
    except ValidationError as e:
        flag = "--" + "-".join(str(p) for p in e.errors()[0]["loc"]).replace("_", "-") if e.errors()[0]["loc"] else ""
        raise KVFoldError(f"{flag or 'options'}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    if recipe.band_align is not None:
        check_align(stats.header.model.head_dim, recipe.band_align)
    if previous is not None:
        if recipe.key_bits is None and previous.key_bits is not None:  # the key floor its search chose (bits)
            recipe = recipe.model_copy(update={"key_bits": previous.key_bits})
        _check_reusable(previous, sha, stats, recipe)
    docs = None if previous else resolve_text(recipe.eval_text)
    return ExportInputs(ref=ref, stats=stats, recipe=recipe, weights_sha256=sha, previous=previous, docs=docs)


def _check_reusable(prev: PreviousExport, sha: str, stats: CalibStats, recipe: Recipe) -> None:
    checks = [
        ("model weights", prev.weights_sha256, sha),
        ("calibration", prev.stats_sha256, stats.header.stats_sha256),
        ("method", prev.method, recipe.method),
        ("rank rounding (--multiple, --min-rank; bits: --band-align)", prev.rounding, recipe.rounding),
        ("--tp", prev.tensor_parallel, recipe.tp),
        ("rank allocation", prev.allocation, recipe.allocation),
        ("cache format", prev.format, recipe.format),
        # bits exports before schema 1.6 stored float16 scales and did not mix their bands
        ("band scale format", prev.band_scale, get_format(recipe.format).band_scale),
        ("--dtype", prev.search_dtype, recipe.dtype),
        ("--sinks / --window", prev.window, (recipe.sinks, recipe.window)),
        ("--key-bits", prev.key_bits, recipe.key_bits),
        ("--search-context / --score-from", (prev.baseline.context, prev.baseline.score_from),
         (recipe.search_context, recipe.score_from)),
    ]
    for what, theirs, ours in checks:
        if theirs != ours:
            raise KVFoldError(f"--reuse-curve: '{prev.path}' was searched with a different {what}; "
                              "export without --reuse-curve")


def model_positions(ref: ModelRef) -> int:
    """The positions the model reaches (its text config's max_position_embeddings; 0 where it names none)."""
    config = AutoConfig.from_pretrained(ref.path).get_text_config()
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def context_positions(recipe: Recipe, previous: PreviousExport | None, net: nn.Module, rope: bool) -> int | None:
    """The context the query/key statistics are averaged over: None for a model without RoPE or --context 0;
    a reused curve keeps its own."""
    if previous is not None:
        if recipe.context is not None and (recipe.context or None) != previous.positions:
            raise KVFoldError(f"--reuse-curve: that export was fitted for --context {previous.positions or 0}; "
                              "export without --reuse-curve, or drop --context")
        return previous.positions
    if not rope or recipe.context == 0:
        return None
    return recipe.context or net.config.get_text_config().max_position_embeddings


def pick(curve: tuple[Point, ...], recipe: Recipe, target: Target | None,
         checked: dict | None) -> tuple[Point, dict | None]:
    """A point of a recorded curve, and its pass-key record when the previous export checked that very point.
    Points whose pass-key check failed there are not picked, nor any more compressed than one that failed: the
    check bisected from the most compressed down (plan/longrange.py) and took those to lose their keys too,
    unchecked."""
    if target is not None:
        lost = min((r["compression"] for r in (checked or {}).get("rejected", [])), default=float("inf"))
        best = best_point([p for p in curve if p.compression < lost] or list(curve), target,
                          where="on the recorded curve")
        same = checked is not None and checked.get("compression") == best.compression
        return best, checked if same else None
    ok = [p for p in curve if p.compression >= recipe.ratio]
    if not ok:
        raise KVFoldError(f"no recorded point reaches compression {recipe.ratio}; export without --reuse-curve")
    return min(ok, key=lambda p: p.compression), None
