"""Per-head rounding sensitivity: the bits format's sensitivity allocation (plan/bits.py's θ per KV head).

The water-filling prices a head's rounding error by its own normalised spectrum, so one θ gives every head the
same *modelled* relative distortion D (Σ_j λ̂_j·2^(−2b_j), a dropped dim counting λ̂_j). What that distortion costs
the model differs between heads: on SmolLM2 (2026-11-28, 2,048 wiki:dev+pydoc:dev tokens, each head alone at the
0.285-of-fp16 plan) the KL per unit of D spans 0.03–10.8 among key heads and 0.004–0.39 among value heads, and
varies as much within a layer as between layers. So, once per export, each KV head's keys (then values) are stored
alone in the probe plan's bands, the rest of the model exact, and its cost is the mean KL against the original
per unit of D. Minimising Σ cost·D + θ·bits gives head h the multiplier θ_h = θ / cost_h; normalised by the
geometric mean over each side's heads (θ_v = v_scale·θ_k stays the split between keys and values) and clipped to
[1/8, 8]. Measured there against one θ for every head, 12,288 wiki:eval+pydoc:eval tokens: KL 0.0130 → 0.0098
at 0.285 of fp16's bytes and 0.0190 → 0.0144 at 0.270; the same costs summed per layer: 0.0112 and 0.0156.
(Removal costs, plan/sensitivity.py, were measured by dropping dims, not rounding them, and made bits plans worse.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfold.factors import LayerBasis
from kvfold.measure.evaluate import Evaluator
from kvfold.measure.stored import banded, compressed
from kvfold.plan.bits import (
    ALIGN,
    BitPlan,
    BitRule,
    bit_factors,
    bits_basis,
    modelled_distortion,
    plan_bits,
    theta_for_mean_bits,
)
from kvfold.progress import progress

__all__ = ["PROBE_BITS", "HeadScales", "measure_head_scales"]

PROBE_BITS = 4.25  # mean bits per number of the probe plan (SmolLM2: 0.285 of fp16's bytes, int4-like)
FLOOR = 0.01  # a head's KL below this share of its side's mean is noise: floored there
CLIP = 8.0


@dataclass(frozen=True)
class HeadScales:
    """Per layer and KV head: multipliers of θ_k / θ_v and the costs behind them (KL per unit of modelled
    distortion). The manifest stores them as head_scale_k/v and head_cost_k/v."""
    k: tuple[tuple[float, ...], ...]
    v: tuple[tuple[float, ...], ...]
    cost_k: tuple[tuple[float, ...], ...]
    cost_v: tuple[tuple[float, ...], ...]


def _scales(costs: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    flat = [c for layer in costs for c in layer]
    floor = FLOOR * sum(max(c, 0.0) for c in flat) / len(flat) or 1e-30
    mean = math.exp(sum(math.log(max(c, floor)) for c in flat) / len(flat))
    return tuple(tuple(min(CLIP, max(1 / CLIP, mean / max(c, floor))) for c in layer) for layer in costs)


def _one_head(quantize: Callable[[torch.Tensor], torch.Tensor], head: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B, H_kv, T, d] -> x with only KV head `head` passed through `quantize` (which takes one head)."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        out[:, head : head + 1] = quantize(x[:, head : head + 1])
        return out

    return apply


def _alone(plan: BitPlan, layer: int, side: str, head: int) -> BitPlan:
    """A one-layer plan: `layer`'s KV head `head` of `side` ("k"/"v") at `plan`'s widths, every other head and
    side of the layer at 16 bits (every dim kept; the probe's patch never stores them)."""
    def widths(of: str, h: int) -> list[int]:
        own = (plan.k_bits if of == "k" else plan.v_bits)[layer][h]
        return list(own) if (of, h) == (side, head) else [16] * plan.head_dim

    heads = range(len(plan.k_bits[layer]))
    return BitPlan([[widths("k", h) for h in heads]], [[widths("v", h) for h in heads]], plan.head_dim, plan.scale)


def measure_head_scales(bases: list[LayerBasis], evaluator: Evaluator, v_scale: float,
                        align: int = ALIGN) -> HeadScales:
    """2 × layers × KV heads evaluations of `evaluator`'s windows (which must keep a Reference, for the KL;
    replay=True makes each cost about half a forward pass), a progress stage (kvfold/progress.py). The probe plan's
    bands are aligned as the export's (`align`, BitRule.align)."""
    widths = BitRule(1.0, 1.0).widths
    theta = theta_for_mean_bits(bases, PROBE_BITS, widths, v_scale, align=align)
    probe = plan_bits(bases, BitRule(theta, v_scale * theta, widths, align=align))
    ordered = [bits_basis(b) for b in bases]
    like = next(evaluator.model.parameters())
    heads = len(probe.k_bits[0])
    costs: dict[str, list[list[float]]] = {"k": [], "v": []}
    with progress("sensitivity probes", 2 * len(bases) * heads, "probes") as advance:
        for side in ("k", "v"):
            for layer in range(len(bases)):
                costs[side].append([])
                for head in range(heads):
                    one = _alone(probe, layer, side, head)
                    quantize = _one_head(banded([one.bands(side, 0)[head]]), head)
                    keep = (quantize, lambda x: x) if side == "k" else (lambda x: x, quantize)
                    patch = compressed(bit_factors([bases[layer]], one)[0], like, *keep)
                    kl = evaluator.score_patches({layer: patch}).kl
                    spectrum = (ordered[layer].qk_spectrum if side == "k" else ordered[layer].v_spectrum)[head]
                    bits = (probe.k_bits if side == "k" else probe.v_bits)[layer][head]
                    costs[side][-1].append(kl / max(modelled_distortion(spectrum, bits), 1e-30))
                    advance()
    as_tuples = {s: tuple(tuple(layer) for layer in c) for s, c in costs.items()}
    return HeadScales(_scales(costs["k"]), _scales(costs["v"]), as_tuples["k"], as_tuples["v"])
