"""The bits format: every rotated dim at its own bit width, in bands of 2–16 bits with per-token scales
(plan/bits.py, kvfold_runtime.bands); the ranks follow from the bits (a dim at 0 bits is dropped).

The search's knob is the water-filling's θ (θ_v = v_scale · θ_k); --allocation sensitivity scales it per KV head
by the KL cost of rounding each head (plan/rounding.py). Torch-free at import (formats/base.py says why): each
method imports what it runs.
"""

from __future__ import annotations

from kvfold.plan.formats.base import LONG_CONTEXT, CacheFormat, scoring_windows

__all__ = ["ALIGN", "ALIGN_SMALL", "SINKS", "V_SCALE", "WINDOW", "BitsFormat", "band_align_for"]

# θ_v = V_SCALE · θ_k by default (plan/bits.py): the proxy there underprices keys' rounding error (it passes through
# the softmax), so with one θ keys got 3.6 bits per number and values 5.4. Measured on SmolLM2 (2026-11-25, 4,096
# wiki:eval tokens, 0.315 of fp16's bytes): V_SCALE 1 → top-1 ratio 0.973, perplexity ratio 1.075, KL 0.084; 4 →
# 0.991, 1.047, 0.043; 16 → 0.984, 1.032, 0.030; 64 → 0.997, 1.033, 0.025 (keys 5.1 bits, values 3.9). At 0.284:
# V_SCALE 64 → KL 0.074 (1: 0.157), 256 → 0.106. Measured again once values were priced by their own variance
# (plan/bits.py; 2026-11-25, 4,096 tokens of wiki:eval+pydoc:eval, 0.2775 of fp16's bytes, no layer multipliers):
# V_SCALE 16 → KL 0.0222, 32 → 0.0191 (perplexity ratio 1.0099), 64 → 0.0205, 256 → 0.0318.
V_SCALE = 32.0
# Every band of a KV head starts and ends on a multiple of `band_align_for(head_dim)` dims (plan/bits.dim_bits' align;
# issue 50): the widths are constant on each chunk of that many dims, so the kept width is a multiple of it too, as
# the GPU page layout and its decode kernel read a head's codes (kvfold_runtime.pages; read from compiled sm_90 code,
# 2026-12-01: a per-dim address table and ~56 instructions per cached number with bands anywhere, 6–9 aligned).
# 16 dims (ALIGN) where head_dim > 64: wider loads, and at 128 the alignment costs −0.4 to +0.45 dB in the
# water-filling's own model (research/align_cost.py). 8 dims (ALIGN_SMALL) at head_dim ≤ 64: there 16 cost SmolLM2
# 1.22x the mean KL of bands anywhere at 0.281 of fp16's bytes (docs/frontier-align-smollm2.json) and 8-dim chunks
# compile to the same instructions per number (8.9 against 8.7 for an 8/5/4 | 6/4 mix, kvfold-bench kernels --aot);
# at head_dim 128 8-dim chunks spill (21.9), so 16 stays there. `--band-align 1`: bands anywhere, the allocation
# before.
ALIGN = 16
ALIGN_SMALL = 8
# A model whose positions reach LONG_CONTEXT is exported in the windowed bits format by default (issue 51): every
# layer's first SINKS and last WINDOW tokens whole, the history in bands, judged at long context (formats/base.py).
# Measured on SmolLM2 (docs/long-context.md): 16 + 64 whole at 3.5 bits met the long-context joint target at 0.247 of
# fp16's bytes at 4K, where no plain bits point up to 0.265 met it, and 4 + 32 missed it on pysrc; at 0.311 of
# fp16's bytes the 16 + 64 cache kept all 10 pass keys at 4K under three roundings (research/passkey_split.py,
# 2026-12-03: closest mean margin +0.183 nats, spread 0.005), where the plain default needed 0.427 to keep them.
SINKS = 16
WINDOW = 64
# Keys' narrowest width (Recipe.key_bits) is plan/bits.KEY_MIN_BITS, 4, in the plain bits cache (set on Qwen at
# 512-token windows). In the windowed cache, unless --key-bits says, export searches with keys down to 2 bits first
# and takes that search's point only if it keeps the pass keys as it is; otherwise it searches again with keys ≥ 4
# bits and checks the pass keys as always (plan/planner._search_floors). Measured at long context (docs/long-context.md,
# 2026-12-05): keys to 2 bits remove the history's cliff between 3.5 and 3 bits — Qwen2.5-Coder-1.5B, 16 + 64 whole,
# 2.5 bits a number 0.182 of fp16's bytes at 4K, KL 0.0050, the joint target met on each text and the pass keys kept
# (+3.97 nats), where keys ≥ 4 bits at 3 bits gave 0.209, KL 0.066; its default export so chose 2 (0.209 against 0.225
# with keys ≥ 4). But on SmolLM2 keys at 2 bits lost 2 of 10 pass keys at their accuracy point (0.230, margin −0.155
# nats), and its export chose keys ≥ 4 bits (0.289, the plan it had before). The first search is the price there
# (666 s of 2,392 on 2 cores).
KEY_FLOORS = (2, 4)


def band_align_for(head_dim: int) -> int:
    """The bits format's band alignment for a model's head_dim (the comment above)."""
    return ALIGN_SMALL if head_dim <= 64 else ALIGN


class BitsFormat(CacheFormat):
    name = "bits"
    layout = "bits"
    summary = "each kept dim stored at 2–16 bits; transformers and vLLM"
    frontier_method = "kvfold-bits"
    v_scale = V_SCALE
    band_align_default = "8 at head_dim ≤ 64, else 16"  # resolve() sets it once the model is known
    # eq6: one θ for every head. sensitivity: KL −25% at equal bytes, but SmolLM2's 0.99 export with it (0.295 of
    # fp16's bytes, 2026-11-28) lost 1 of 10 pass keys in the runtime that its simulated check kept
    allocation = "eq6"
    sensitivity_tokens = 2048  # its probes are per KV head: 2 × layers × KV heads of them
    sensitivity_of = "KV head's rounding"
    sensitivity_compares = True  # the KL per unit of rounding distortion

    def check(self, recipe):
        if recipe.tp > 1:
            raise ValueError("--tp balances the rank format's widths; a bits export's band rows are not balanced yet "
                             "(serve it with tensor_parallel_size=1, or export --format rank --tp N)")
        if recipe.ratio is not None:
            raise ValueError("the bits format is searched for an accuracy: give --accuracy or --max-kl, not --ratio")

    def resolve(self, recipe, head_dim, positions):
        update = {"band_align": recipe.band_align or band_align_for(head_dim)}
        if recipe.sinks is None and recipe.window is None:  # the windowed format where the model serves long context
            long = positions >= LONG_CONTEXT
            update |= {"sinks": SINKS if long else 0, "window": WINDOW if long else 0}
        else:
            update |= {"sinks": recipe.sinks or 0, "window": recipe.window or 0}
        if recipe.key_bits is None and not (update["sinks"] or update["window"]):
            from kvfold.plan.bit_plan import KEY_MIN_BITS

            update["key_bits"] = KEY_MIN_BITS  # windowed: None, chosen by the search (KEY_FLOORS)
        return scoring_windows(recipe.model_copy(update=update), positions)

    def key_floors(self, recipe):
        return KEY_FLOORS if recipe.key_bits is None else (recipe.key_bits,)

    def rounding(self, recipe):
        # the ranks follow from the bits (multiple and min_rank do not apply), so they are multiples of the bands'
        # alignment: recorded as the manifest's rounding_multiple, and a reused curve must share it
        assert recipe.band_align is not None, "band_align depends on the model: resolve(recipe, head_dim) first"
        return recipe.band_align, 0

    @property
    def band_scale(self):
        from kvfold.plan.bits import SCALE

        return SCALE

    def rule(self, recipe, r, r_v, multipliers):
        from kvfold.plan.bits import BitRule

        assert recipe.key_bits is not None, "key_bits depends on the window: resolve(recipe, head_dim) first"
        return BitRule(theta_k=r, theta_v=r_v, align=recipe.band_align, sinks=recipe.sinks, window=recipe.window,
                       key_min=recipe.key_bits, **multipliers)

    def plan(self, bases, rule):
        from kvfold.plan.bits import plan_bits

        return plan_bits(bases, rule)

    def scorer(self, bases, evaluator):
        from kvfold.plan.targets import bit_patches

        like = next(evaluator.model.parameters())  # the model's dtype and device
        # each plan scored on the cache it would store: band codes and scales (measure/stored.py)
        return lambda plan: (evaluator.score_patches(bit_patches(bases, plan, like)), evaluator.baseline)

    def export_parts(self, bases, rule):
        from kvfold.plan.bits import bit_factors, plan_bits

        bits = plan_bits(bases, rule)
        return bits.ranks(), bits, bit_factors(bases, bits)

    def sensitivity(self, bases, probe, recipe, log):
        from kvfold.plan.rounding import measure_head_scales

        return measure_head_scales(bases, probe, recipe.v_scale, recipe.band_align)

    def passkey_patches(self, bases, evaluator, rule, like):
        from kvfold.plan.bits import plan_bits
        from kvfold.plan.longrange import NUDGES
        from kvfold.plan.targets import bit_patches

        plan = plan_bits(bases, rule)  # three roundings of the cache (plan/longrange.py)
        return [bit_patches(bases, plan, like, nudge) for nudge in NUDGES]

    def search_range(self, rule):
        # θ from 1e-7 on the side with the larger θ (about 8 bits for a head's average dim: int8-like) to θ_k = 0.1
        # (nearly every dim dropped)
        unit = rule(1.0)
        return 1e-7 / max(1.0, unit.theta_v / unit.theta_k), 0.1
