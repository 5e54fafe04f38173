"""An export's measurements kept on disk as they are made, so that an export that was stopped (a killed job, a
closed laptop, a machine taken back) and is run again with the same inputs takes them from the disk instead of
measuring them again. On a 2-core CPU (bfloat16, 2026-12-05) one candidate of Qwen2.5-Coder-1.5B's long-context search
took ~220 s and each rounding of its pass-key check ~470 s: its default export was 5,463 s of measurements.

What is kept: each scored candidate's figures (keyed by its plan, `plan.key()`) and each pass-key answer set (keyed
by the point's knob and the rounding). The file is keyed by everything a measurement depends on: the weights' and
the calibration's hashes, the whole recipe (its dtype and target included), the device, and kvfold's and torch's
versions; it lives at $KVFOLD_CACHE/journal/KEY.jsonl, one JSON line per measurement (a line cut short by a kill is
skipped), and is deleted once the export is written. A resumed export still scores the original first: every new
candidate's KL compares with the original's predictions, which are held in memory only. If the original's figures
differ from the journal's (another text package, another machine's arithmetic), the journal is set aside and every
candidate is measured again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from kvfold.measure.metrics import Metrics
from kvfold.measure.passkey import Answers

__all__ = ["Journal"]

BASELINE_RTOL = 1e-6  # the original's NLL may differ by this much between runs and the journal still apply


class Journal:
    """Measurements by key, read from `path` and appended to it as they are made; `path` None keeps nothing."""

    def __init__(self, path: Path | None, log: Callable[[str], None] = lambda line: None) -> None:
        self.path, self.log = path, log
        self._entries: dict[str, dict] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self._entries[entry["key"]] = entry["value"]
                except (ValueError, KeyError, TypeError):
                    continue  # the last line of a run killed while writing it
        self.resumed = len(self._entries)

    @classmethod
    def of(cls, what: dict, log: Callable[[str], None] = lambda line: None) -> Journal:
        """The journal of the export whose inputs are `what` (JSON-able; the caller names everything its
        measurements depend on), under $KVFOLD_CACHE/journal."""
        from kvfold.sources.embedded import cache_root

        key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return cls(cache_root() / "journal" / f"{key}.jsonl", log)

    def check_baseline(self, baseline: Metrics) -> None:
        """Set the journal aside if the original scores differently now than when it was written."""
        old = self._entries.get("baseline")
        if old is not None and not (old["tokens"] == baseline.tokens and old["top1"] == baseline.top1
                                    and math.isclose(old["nll"], baseline.nll, rel_tol=BASELINE_RTOL)):
            self.log(f"{self.path}: the original scores differently than when these measurements were made; "
                     "measuring every candidate again")
            self._entries.clear()
            if self.path is not None:
                self.path.unlink(missing_ok=True)
        if self._entries:
            self.log(f"resuming from {self.path}: {len(self._entries) - 1} measurements kept")
        else:
            self._keep("baseline", asdict(baseline))

    def scorer(self, score: Callable, baseline: Metrics) -> Callable:
        """`score` (plan -> (candidate's Metrics, the original's)) taking each candidate from the journal when it
        holds it, and recording the others."""
        def scored(plan) -> tuple[Metrics, Metrics]:
            key = "score " + hashlib.sha256(repr(plan.key()).encode()).hexdigest()
            if key in self._entries:
                return _metrics(self._entries[key]), baseline
            cand, base = score(plan)
            self._keep(key, asdict(cand))
            return cand, base
        return scored

    def answers(self, key: str, run: Callable[[], Answers]) -> Answers:
        """The pass-key answers recorded under `key`, or `run()`'s, recorded."""
        key = "passkey " + key
        if key not in self._entries:
            self._keep(key, run()._asdict())
        return Answers(**self._entries[key])

    def close(self) -> None:
        """The export is written: its measurements are in its manifest, the journal goes."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def _keep(self, key: str, value: dict) -> None:
        self._entries[key] = value
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:  # one line a measurement: a kill loses at most the line being written
            f.write(json.dumps({"key": key, "value": value}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _metrics(raw: dict) -> Metrics:
    return Metrics(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
