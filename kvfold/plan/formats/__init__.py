"""The cache formats of `kvfold export --format`, registered by name: one class each (formats/base.py says what a
format owns). Adding one = a file with its class + a line in FORMATS + a test."""

from __future__ import annotations

from kvfold.plan.formats.base import CacheFormat
from kvfold.plan.formats.bits import BitsFormat
from kvfold.plan.formats.rank import RankFormat

__all__ = ["DEFAULT_FORMAT", "FORMATS", "CacheFormat", "choices", "get_format"]

FORMATS: dict[str, CacheFormat] = {f.name: f for f in (RankFormat(), BitsFormat())}
DEFAULT_FORMAT = RankFormat.name  # Recipe.format's default


def choices() -> str:
    """The registered names as a choice error lists them: "'rank' or 'bits'"."""
    names = [repr(name) for name in FORMATS]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def get_format(name: str) -> CacheFormat:
    """The format registered as `name`; ValueError naming the choices otherwise (Recipe turns it into a flag's
    one-line error)."""
    if name not in FORMATS:
        raise ValueError(f"Input should be {choices()}")
    return FORMATS[name]
