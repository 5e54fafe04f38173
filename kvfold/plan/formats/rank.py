"""The rank format: each rotated KV head keeps its top d_k / d_v dims, stored in the model's dtype (plan/ranks.py).

The search's knob is the papers' removal rate r (r_v = v_scale · r); --allocation sensitivity scales it per layer
by the NLL cost of removing each layer's dims (plan/sensitivity.py). Torch-free at import (formats/base.py says
why): each method imports what it runs.
"""

from __future__ import annotations

from kvfold.plan.formats.base import CacheFormat

__all__ = ["RankFormat"]


class RankFormat(CacheFormat):
    name = "rank"
    layout = "rank"
    summary = "k', v' at the chosen ranks"
    frontier_method = "kvfold"
    v_scale = 1.0  # one r for keys and values, as in the papers
    # eq6: one r for every head. sensitivity cut layers that long-range retrieval needs: with the pass-key check
    # (plan/longrange.py) SmolLM2's 0.99 export kept p = 0.0201 with eq6 and 0.0111 with it (README "Long context")
    allocation = "eq6"
    sensitivity_tokens = 4096
    sensitivity_of = "layer's"
    sensitivity_compares = False  # the NLL cost of removed dims

    def check(self, recipe):
        if recipe.band_align is not None:
            raise ValueError("--band-align places the bits format's bands; the rank format rounds its ranks with "
                             "--multiple")
        if recipe.key_bits is not None:
            raise ValueError("--key-bits sets the bits format's narrowest key band; the rank format stores keys at "
                             "the model's dtype (use --format bits)")
        if recipe.sinks or recipe.window:
            raise ValueError("--sinks and --window keep tokens whole beside the bits format's codes; the rank format "
                             "stores every token alike (use --format bits)")

    def rule(self, recipe, r, r_v, multipliers):
        from kvfold.plan.ranks import RankRule

        multiple, min_rank = self.rounding(recipe)
        return RankRule(r_k=r, r_v=r_v, multiple=multiple, min_rank=min_rank, tp=recipe.tp, **multipliers)

    def plan(self, bases, rule):
        from kvfold.plan.ranks import plan_ranks

        return plan_ranks(bases, rule)

    def scorer(self, bases, evaluator):
        from kvfold.plan.ranks import factors_for

        return lambda ranks: (evaluator.score(factors_for(bases, ranks)), evaluator.baseline)

    def export_parts(self, bases, rule):
        from kvfold.plan.ranks import factors_for, plan_ranks

        ranks = plan_ranks(bases, rule)
        return ranks, None, factors_for(bases, ranks)

    def sensitivity(self, bases, probe, recipe, log):
        from kvfold.plan.sensitivity import measure_scales

        return measure_scales(bases, probe, self.rounding(recipe)[1])

    def passkey_patches(self, bases, evaluator, rule, like):
        from kvfold.plan.ranks import factors_for, plan_ranks

        return [evaluator.patches(factors_for(bases, plan_ranks(bases, rule)), like)]
