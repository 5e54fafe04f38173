"""The attention changes the frontier benchmark scores, as patches around each layer's attention call
(kvfold.hooks) or maps of a projection's output. Each one is what a serving engine would do to
the tensors it caches; the model otherwise runs unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from kvfold.adapters import Adapter
from kvfold.hooks import AttentionPatch
from kvfold.measure.stored import banded, compressed

__all__ = ["FP8_MAX", "ProjMap", "banded", "compressed", "key_channel_mask", "mapped_projections",
           "nudged", "quantized_kv"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ProjMap = Callable[[torch.Tensor], torch.Tensor]  # a projection's output [B, T, H_kv*d] -> the same


def quantized_kv(quantize: Callable[[torch.Tensor], torch.Tensor]) -> AttentionPatch:
    """Keys (post-RoPE) and values pass through `quantize`, as they would through the cache."""
    return AttentionPatch(before=lambda q, k, v: (q, quantize(k), quantize(v)))


def key_channel_mask(mask: torch.Tensor) -> AttentionPatch:
    """mask [H_kv, d] of 0/1: pruned key channels are zero in the cache (ThinK); queries unchanged."""

    def before(q, k, v):
        return q, k * mask.to(k.dtype)[None, :, None, :], v

    return AttentionPatch(before=before)


@contextmanager
def mapped_projections(model: nn.Module, adapter: Adapter, maps: dict[tuple[int, str], ProjMap]) -> Iterator[None]:
    """Within the block, layer i's k_proj ("k") / v_proj ("v") output goes through maps[(i, kind)]:
    before QK-norm and RoPE, which is where Palu's low-rank latent sits."""
    attns = adapter.attention_modules(model)
    handles = []
    try:
        for (layer, kind), fn in maps.items():
            proj = getattr(attns[layer], adapter.k_proj if kind == "k" else adapter.v_proj)
            handles.append(proj.register_forward_hook(lambda _m, _args, out, fn=fn: fn(out)))
        yield
    finally:
        for h in handles:
            h.remove()


def nudged(patches: dict[int, AttentionPatch], nudge: float) -> dict[int, AttentionPatch]:
    """The same patches with each key and value number scaled by 1 ± `nudge` (a fixed random sign per number)
    before them: another rounding of whatever cache they store, for any method. Rounding is discontinuous, so a
    nudge of 1e-6 flips codes at level boundaries and draws the cache's noise again (export draws its own bits
    cache the same way, plan/stored.banded); a cache that does not round barely moves. Signs, not one factor:
    a scale computed from the numbers themselves (vLLM's per-token float32 scales) would absorb a common factor
    and round every number as before."""
    if not nudge:
        return patches

    def jitter(x: torch.Tensor) -> torch.Tensor:
        signs = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(0)).to(x) * 2 - 1
        return x * (1.0 + nudge * signs)

    def wrap(patch: AttentionPatch) -> AttentionPatch:
        inner = patch.before or (lambda q, k, v: (q, k, v))
        return dataclasses.replace(patch, before=lambda q, k, v: inner(q, jitter(k), jitter(v)))

    return {i: wrap(patch) for i, patch in patches.items()}
