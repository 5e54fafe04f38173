"""`kvfold verify EXPORTED`: integrity first; the serving checks only when the files are intact."""

from __future__ import annotations

from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.sources.models import DTYPES, check_device_map, resolve_device, resolve_model, run_dtype
from kvfold.sources.text import resolve_text
from kvfold.verify.integrity import integrity_checks
from kvfold.verify.report import VerifyReport
from kvfold.verify.serving import serving_checks

__all__ = ["verify"]


DEFAULT_TEXTS = ("wiki:eval", "pydoc:eval")  # held-out text of the search's domain, and of another


def verify(export: Path, against: str | None = None, eval_texts: list[str] | tuple[str, ...] = DEFAULT_TEXTS,
           eval_tokens: int = 16384, context: int | None = None, passkey: int = 4096,
           dtype: str = "auto", device: str = "auto", new_tokens: int = 32,
           device_map: str | None = None, score_from: int | None = None) -> VerifyReport:
    """Scores `eval_tokens` of each text in windows of `context` tokens (None: the export's search windows, 512
    tokens unless it was searched with --search-context), each from position `score_from` on (None: the search's
    where the windows are the search's, else 1), passkey retrieval in prompts of
    `passkey` tokens (0: skip) and `new_tokens` greedy tokens of a few prompts, both models in `dtype` (auto:
    sources.models.run_dtype's rule for the source, as export ran it) on `device` (`device_map` "auto": each
    placed by accelerate). Raises KVFoldError for bad
    input (not an export, source model not found); failed checks are in the report."""
    export = Path(export)
    if not export.is_dir():
        raise KVFoldError(f"'{export}' is not a directory; pass the output of kvfold export")
    if eval_tokens < 2:
        raise KVFoldError("--eval-tokens must be at least 2")
    if context is not None and context < 2:
        raise KVFoldError("--context must be at least 2 tokens")
    if 0 < passkey < 256:
        raise KVFoldError("--passkey must be 0 (skip) or at least 256 tokens")
    if new_tokens < 1:
        raise KVFoldError("--new-tokens must be at least 1")
    if not eval_texts:
        raise KVFoldError("give at least one --eval-text")
    if dtype != "auto" and dtype not in DTYPES:
        raise KVFoldError(f"--dtype must be one of auto, {', '.join(DTYPES)}, got '{dtype}'")
    device, device_map = resolve_device(device), check_device_map(device_map)
    for text in eval_texts:
        resolve_text(text)  # a bad name fails now, before any model loads
    manifest, checks = integrity_checks(export)
    report = VerifyReport(export=str(export), checks=checks)
    if not report.ok:
        return report
    spec = against or manifest.source.path
    if against is None and not Path(spec).is_dir() and manifest.source.hub_id:  # the Hub's copy, at its commit
        spec = f"{manifest.source.hub_id}@{manifest.source.revision}"
    elif against is None and not Path(spec).is_dir():
        raise KVFoldError(f"the source model {spec} recorded in the manifest is not on this machine; "
                          "pass --against MODEL")
    context = context or manifest.search_context
    if score_from is None:
        score_from = manifest.score_from if context == manifest.search_context else 1
    if not 1 <= score_from < context:
        raise KVFoldError(f"--score-from must be at least 1 and less than the windows' {context} tokens")
    ref = resolve_model(spec)
    report.against = str(ref.path)
    serving_checks(export, manifest, ref, report, list(eval_texts), eval_tokens, context, passkey,
                   new_tokens=new_tokens, dtype=run_dtype(ref, dtype, device), device=device, device_map=device_map,
                   score_from=score_from)
    return report
