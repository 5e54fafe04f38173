"""What a frontier method is: a name, a legend label, and the candidates of its sweep, mildest first."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvfold.hooks import AttentionPatch

from ..patches import ProjMap

if TYPE_CHECKING:
    from ..setup import Setup

__all__ = ["Candidate", "Method"]


@dataclass(frozen=True)
class Candidate:
    knob: float  # the method's own setting (removal rate r, rank, pruned fraction, ...)
    kv_fraction: float  # KV-cache bytes per token / the original's at fp16
    patches: dict[int, AttentionPatch] = field(default_factory=dict)  # layer -> around attention
    proj_maps: dict[tuple[int, str], ProjMap] = field(default_factory=dict)  # (layer, "k"|"v") -> output map
    # where the bytes per token depend on the context (whole sink and recent tokens): the fraction at 32K tokens
    kv_fraction_32k: float | None = None


class Method(Protocol):
    name: str
    label: str  # legend text
    knob: str  # what Candidate.knob means
    # The sweep starts from this point instead of the original (1.0 bytes, ratio 1.0), e.g. "fp8" for
    # kvfold+fp8, whose mildest setting is fp8 alone.
    origin: str | None

    def candidates(self, setup: Setup) -> Iterator[Candidate]: ...
