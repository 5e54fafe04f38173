"""kvfold itself and its ablations: one class, each registered variant changes one choice.

kvfold = output-aware V + whitened Q/K factors (factors/aware.py) from text calibration, ranks
from removal rates scaled per layer by measured sensitivity (plan/sensitivity.py). Ablations: one rate r
for K and V in every head (eq6, the papers' rule) with r_v = r_k or r_v = r_k / 4; random-token or ZDC
(pruned + K-means) calibration instead of text — their sensitivity multipliers are kvfold's own, measured
once per model (setup.layer_scales), so those two differ from kvfold in their calibration alone.
`fp8=True` stores the compressed k', v' in vLLM's fp8 at its default scale 1.0, as the runtime's fp8
cache does (kvfold_runtime.kernels.paged.NumberRows).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvfold.plan.ranks import RankRule, factors_for, plan_ranks

from ..patches import compressed
from .base import Candidate
from .vllm_kv import fp8_per_tensor_roundtrip

__all__ = ["KVFold"]


@dataclass(frozen=True)
class KVFold:
    name: str = "kvfold"
    label: str = "kvfold"
    calib: str = "text"  # a setup.CALIBRATIONS name
    allocation: str = "sensitivity"  # or "eq6": one removal rate for every head
    v_scale: float = 1.0  # r_v = v_scale · r_k
    fp8: bool = False
    grid: tuple[float, ...] = (0.005, 0.01, 0.015, 0.02, 0.03)
    knob: str = "removal rate r"
    factors: str = "aware"

    @property
    def origin(self) -> str | None:
        return "fp8" if self.fp8 else None

    def candidates(self, setup) -> Iterator[Candidate]:
        bases = setup.bases(self.factors, self.calib)
        scales = setup.layer_scales() if self.allocation == "sensitivity" else None
        for r in self.grid:
            rule = RankRule(r_k=r, r_v=self.v_scale * r, multiple=setup.multiple, min_rank=min(8, setup.multiple),
                            layer_k=scales.k if scales else (), layer_v=scales.v if scales else ())
            ranks = plan_ranks(bases, rule)
            quantize = fp8_per_tensor_roundtrip if self.fp8 else None
            patches = {i: compressed(f, setup.dtype, quantize) for i, f in enumerate(factors_for(bases, ranks))}
            yield Candidate(r, (1 - ranks.compression) * (0.5 if self.fp8 else 1.0), patches)
