"""`kvfold export`: plan (plan/planner.py) -> the plan's factors baked into the weights -> checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfold.checkpoint.manifest import Calibration, Manifest, SourceModel
from kvfold.checkpoint.writer import write_checkpoint
from kvfold.io import atomic_dir
from kvfold.plan.export_plan import ExportInputs
from kvfold.plan.journal import Journal
from kvfold.plan.planner import plan_export
from kvfold.plan.recipe import Recipe
from kvfold.plan.reuse import check_inputs
from kvfold.rewrite.bake import bake
from kvfold.sources.models import check_device_map, resolve_device, resolve_model, run_dtype

__all__ = ["ExportResult", "export"]


@dataclass(frozen=True)
class ExportResult:
    manifest: Manifest
    output: Path


def export(model: str, calib: Path, output: Path, recipe: Recipe, *, reuse_curve: Path | None = None,
           force: bool = False, device: str = "auto", device_map: str | None = None,
           log: Callable[[str], None] = lambda line: None) -> ExportResult:
    """Choose per-head ranks for the recipe's target, bake them, write a checkpoint atomically.

    The model runs in recipe.dtype (auto: sources.models.run_dtype's rule) on `device` (auto: CUDA when
    present; `device_map` "auto": placed by accelerate, sources.models.from_pretrained), the pass-key check
    included; the baked weights are written in
    the source checkpoint's dtype, from weights read in that dtype.

    With `reuse_curve` (a previous export of the same model, calibration, method and rounding), the
    point is picked from its recorded curve and nothing is evaluated again. `log` gets one plain line
    per stage and per scored candidate. An export stopped before it was written and run again with the same
    inputs takes what it had measured from its journal (plan/journal.py)."""
    ref, device, device_map = resolve_model(model), resolve_device(device), check_device_map(device_map)
    recipe = recipe.model_copy(update={"dtype": run_dtype(ref, recipe.dtype, device)})  # what --reuse-curve checks
    previous = Manifest.load(Path(reuse_curve)).previous_export(Path(reuse_curve)) if reuse_curve else None
    inputs = check_inputs(ref, Path(calib), recipe, previous)  # before any output exists: bad input fails at once
    journal = None if previous else Journal.of(_measured_on(inputs, device, device_map), log)
    with atomic_dir(Path(output), force=force) as tmp:
        plan = plan_export(inputs, device, log, device_map, journal)
        log(f"chosen: {plan.chosen.describe(recipe.eval_text)}; writing the checkpoint")
        # in place: the plan's model is not run again, and the export never holds a second model (issue 52)
        baked = bake(plan.model, ref.adapter, list(plan.factors), in_place=True)
        manifest = Manifest.from_plan(plan, baked, source=SourceModel.of(ref, inputs.weights_sha256),
                                      calibration=Calibration.of(inputs.stats.header))
        manifest = write_checkpoint(baked, ref.path, manifest, tmp)
    if journal is not None:
        journal.close()
    return ExportResult(manifest=manifest, output=Path(output))


def _measured_on(inputs: ExportInputs, device: str, device_map: str | None) -> dict:
    """Everything an export's measurements depend on, which names its journal."""
    import torch

    from kvfold import __version__

    return {"weights": inputs.weights_sha256, "stats": inputs.stats.header.stats_sha256,
            "recipe": inputs.recipe.model_dump(mode="json"), "device": device, "device_map": device_map,
            "kvfold": __version__, "torch": torch.__version__}
