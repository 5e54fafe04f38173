"""Factor methods, one small class each, registered by name. Adding one = a file + a line here."""

from __future__ import annotations

from kvfold.errors import KVFoldError
from kvfold.rewrite.factors.aware import AwareFactors
from kvfold.rewrite.factors.base import LayerBasis, LayerFactors
from kvfold.rewrite.factors.zack import ZackFactors

__all__ = ["METHODS", "LayerBasis", "LayerFactors", "get_method"]

METHODS = {m.name: m for m in (AwareFactors, ZackFactors)}


def get_method(name: str):
    if name not in METHODS:
        raise KVFoldError(f"unknown --method '{name}'; choose one of: {', '.join(METHODS)}")
    return METHODS[name]()
