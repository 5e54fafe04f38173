"""The accuracy–compression frontier: kvfold, its ablations, the papers' method and the peers, swept on
held-out text, written as JSON (every point) and PNG. Files: setup.py (shared pieces per model),
patches.py (what each method does to attention), methods/ (one class per method), sweep.py (scores
and the compression at the target), run.py (models and report), plot.py (the picture)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.io import atomic_write_text
from kvfold.sources.models import resolve_model

from .methods import get_methods
from .plot import draw, pyplot
from .run import run_frontier

__all__ = ["bench_frontier"]


def bench_frontier(models: list[str], methods: list[str] | None, target: float, eval_text: str, eval_tokens: int,
                   calib_tokens: int, sensitivity_tokens: int, multiple: int, json_path: Path | None,
                   png_path: Path | None) -> dict:
    """Run the frontier and write its JSON and PNG (each atomically; nothing is written on failure)."""
    get_methods(list(methods or []))  # bad names and paths fail before any work
    for spec in models:
        resolve_model(spec)
    for path in (json_path, png_path):
        if path is not None and not Path(path).parent.is_dir():
            raise KVFoldError(f"folder '{Path(path).parent}' does not exist; create it or choose another path")
    if eval_tokens < 1024:
        raise KVFoldError("--eval-tokens must be at least 1024 (two 512-token windows give a standard error)")
    if not 0.0 < target <= 1.0:
        raise KVFoldError(f"--accuracy must be in (0, 1], got {target}")
    if calib_tokens < 1024 or sensitivity_tokens < 1 or multiple < 1:
        raise KVFoldError("--calib-tokens must be at least 1024, --sensitivity-tokens and --multiple at least 1")
    if png_path is not None:
        pyplot()  # a missing plotting library fails now, not after the sweep
    report = run_frontier(models, methods, target, eval_text, eval_tokens, calib_tokens, sensitivity_tokens,
                          multiple)
    tmp = None if png_path is None else Path(png_path).with_name(f".{Path(png_path).name}.tmp.png")
    try:
        if tmp is not None:
            draw(report, tmp)
        if json_path is not None:
            atomic_write_text(Path(json_path), json.dumps(report, indent=2) + "\n")
        if tmp is not None:
            os.replace(tmp, png_path)
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return report
