"""fp8: vLLM's `--kv-cache-dtype fp8` as a user runs it, at its default k/v scales (1.0, no calibrated scales in
the checkpoint): keys (post-RoPE) and values stored as float8 e4m3 codes of x / 1.0, saturated at ±448, nothing
else changed. Half the bytes of fp16 at one fixed point. The arithmetic and vLLM's sources for it:
vllm_kv.fp8_per_tensor_encode and that module's docstring."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..patches import quantized_kv
from .base import Candidate
from .vllm_kv import fp8_per_tensor_roundtrip

__all__ = ["Fp8"]


@dataclass(frozen=True)
class Fp8:
    name: str = "fp8"
    label: str = "vLLM fp8 (e4m3, scale 1.0, its default)"
    knob: str = "none"
    origin: str | None = None

    def candidates(self, setup) -> Iterator[Candidate]:
        layers = len(setup.adapter.attention_modules(setup.model))
        yield Candidate(0.0, 0.5, {i: quantized_kv(fp8_per_tensor_roundtrip) for i in range(layers)})
