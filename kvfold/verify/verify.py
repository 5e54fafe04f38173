"""`kvfold verify EXPORTED`: integrity first; the serving checks only when the files are intact."""

from __future__ import annotations

from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.sources.models import resolve_model
from kvfold.verify.integrity import integrity_checks
from kvfold.verify.report import VerifyReport
from kvfold.verify.serving import serving_checks

__all__ = ["verify"]


def verify(export: Path, against: str | None = None, eval_text: str = "wiki:eval",
           eval_tokens: int = 16384) -> VerifyReport:
    """Raises KVFoldError for bad input (not an export, source model not found); failed checks are in
    the report."""
    export = Path(export)
    if not export.is_dir():
        raise KVFoldError(f"'{export}' is not a directory; pass the output of kvfold export")
    if eval_tokens < 2:
        raise KVFoldError("--eval-tokens must be at least 2")
    manifest, checks = integrity_checks(export)
    report = VerifyReport(export=str(export), checks=checks)
    if not report.ok:
        return report
    spec = against or manifest.source.path
    if against is None and not Path(spec).is_dir():
        raise KVFoldError(f"the source model {spec} recorded in the manifest is not on this machine; "
                          "pass --against MODEL")
    ref = resolve_model(spec)
    report.against = str(ref.path)
    serving_checks(export, manifest, ref, report, eval_text, eval_tokens)
    return report
