"""Writing a benchmark's JSON and PNG: paths checked before the work, each file written atomically, the
PNG drawn before the JSON lands so that a failed drawing leaves neither."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.io import atomic_write_text

__all__ = ["check_paths", "write_outputs"]


def check_paths(*paths: Path | None) -> None:
    for path in paths:
        if path is not None and not Path(path).parent.is_dir():
            raise KVFoldError(f"folder '{Path(path).parent}' does not exist; create it or choose another path")


def write_outputs(report: dict, json_path: Path | None, png_path: Path | None,
                  draw: Callable[[dict, Path], None]) -> None:
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
