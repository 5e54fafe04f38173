"""fp8: keys and values stored as float8 e4m3 with one scale per layer and tensor (vLLM's
kv_cache_dtype="fp8"), nothing else changed: half the bytes of fp16 at one fixed point."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..patches import fp8_roundtrip, quantized_kv
from .base import Candidate

__all__ = ["Fp8"]


@dataclass(frozen=True)
class Fp8:
    name: str = "fp8"
    label: str = "fp8 e4m3 KV"
    knob: str = "none"
    origin: str | None = None

    def candidates(self, setup) -> Iterator[Candidate]:
        layers = len(setup.adapter.attention_modules(setup.model))
        yield Candidate(0.0, 0.5, {i: quantized_kv(fp8_roundtrip) for i in range(layers)})
