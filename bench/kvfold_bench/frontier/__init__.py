"""The accuracy–compression frontier: kvfold, its ablations, the papers' method and the peers, swept on
held-out text, written as JSON (every point) and PNG. Files: setup.py (shared pieces per model),
patches.py (what each method does to attention), methods/ (one class per method), sweep.py (scores
and the compression at the target), run.py (models and report), plot.py (the picture)."""

from __future__ import annotations

from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.sources.models import resolve_model
from kvfold.sources.text import resolve_text
from kvfold_bench.outputs import check_paths, write_outputs

from .methods import get_methods
from .plot import draw, pyplot
from .run import run_frontier

__all__ = ["bench_frontier"]


def bench_frontier(models: list[str], methods: list[str] | None, target: float, eval_text: str, eval_tokens: int,
                   calib_tokens: int, sensitivity_tokens: int, multiple: int, json_path: Path | None,
                   png_path: Path | None, context: int = 512, passkey: int = 0,
                   calib_text: str = "wiki:calib", score_from: int = 1) -> dict:
    """Run the frontier and write its JSON and PNG (each atomically; nothing is written on failure)."""
    get_methods(list(methods or []))  # bad names and paths fail before any work
    for spec in models:
        resolve_model(spec)
    check_paths(json_path, png_path)
    resolve_text(calib_text)  # a bad text name fails before any model loads
    if context < 2 or eval_tokens < 2 * context:
        raise KVFoldError("--eval-tokens must be at least twice --context (two windows give a standard error)")
    if not 1 <= score_from < context:
        raise KVFoldError(f"--score-from must be at least 1 and less than --context ({context}), got {score_from}")
    if 0 < passkey < 256:
        raise KVFoldError("--passkey must be 0 (skip) or at least 256 tokens")
    if not 0.0 < target <= 1.0:
        raise KVFoldError(f"--accuracy must be in (0, 1], got {target}")
    if calib_tokens < 1024 or sensitivity_tokens < 1 or multiple < 1:
        raise KVFoldError("--calib-tokens must be at least 1024, --sensitivity-tokens and --multiple at least 1")
    if png_path is not None:
        pyplot()  # a missing plotting library fails now, not after the sweep
    report = run_frontier(models, methods, target, eval_text, eval_tokens, calib_tokens, sensitivity_tokens,
                          multiple, context=context, passkey=passkey, calib_text=calib_text, score_from=score_from)
    write_outputs(report, json_path, png_path, draw)
    return report
