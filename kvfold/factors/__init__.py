"""Stage 2, factors: per-head rotations from the calibration statistics, ordered by importance (the plan
cuts them at its ranks). One small class per method, registered by name: adding one = a file + a line here.
positions.py averages the RoPE statistics over the served context; weights.py reads W_O per head."""

from __future__ import annotations

from kvfold.errors import KVFoldError
from kvfold.factors.aware import AwareFactors
from kvfold.factors.base import LayerBasis, LayerFactors
from kvfold.factors.zack import ZackFactors

__all__ = ["METHODS", "LayerBasis", "LayerFactors", "get_method"]

METHODS = {m.name: m for m in (AwareFactors, ZackFactors)}


def get_method(name: str):
    if name not in METHODS:
        raise KVFoldError(f"unknown --method '{name}'; choose one of: {', '.join(METHODS)}")
    return METHODS[name]()
