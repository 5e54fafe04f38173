"""Sensitivity allocation: cheap layers get larger removal rates, measured on the real model code."""

import pytest

from kvfold.adapters import get_adapter
from kvfold.calib.tokens import random_sequences
from kvfold.factors import get_method
from kvfold.factors.weights import o_proj_heads
from kvfold.measure.evaluate import Evaluator
from kvfold.plan.ranks import RankRule, plan_ranks
from kvfold.plan.sensitivity import CLIP, _scales, measure_scales
from tests.conftest import VOCAB, build_tiny
from tests.factors.test_factors import tiny_stats


def test_cheaper_layers_get_larger_multipliers_within_the_clip():
    w = _scales([1e-3, 1e-4, 0.0, -5e-4, 1.0])
    assert w[2] == w[3]  # a negative cost is noise: floored like zero
    assert w[3] > w[1] > w[0] > w[4]
    assert max(w) <= CLIP and min(w) == pytest.approx(1 / CLIP)


def test_layer_multipliers_change_only_their_layer():
    model = build_tiny("LlamaForCausalLM")
    stats = tiny_stats(model, "LlamaForCausalLM")
    adapter = get_adapter("LlamaForCausalLM")
    bases = [get_method("aware").basis(stats, i, o_proj_heads(model, adapter, i)) for i in range(2)]
    plain = plan_ranks(bases, RankRule(0.1, 0.1, multiple=1, min_rank=1))
    scaled = plan_ranks(bases, RankRule(0.1, 0.1, multiple=1, min_rank=1, layer_k=(1.0, 3.0), layer_v=(1.0, 1.0)))
    assert scaled.d_k[0] == plain.d_k[0] and scaled.d_v == plain.d_v
    assert sum(scaled.d_k[1]) < sum(plain.d_k[1])


def test_measure_scales_scores_each_layer_and_kind_once():
    model = build_tiny("LlamaForCausalLM")
    stats = tiny_stats(model, "LlamaForCausalLM")
    adapter = get_adapter("LlamaForCausalLM")
    bases = [get_method("aware").basis(stats, i, o_proj_heads(model, adapter, i)) for i in range(2)]
    evaluator = Evaluator(model, adapter, random_sequences(VOCAB, 256, 64, seed=3))
    calls = []
    score = evaluator.score
    evaluator.score = lambda factors, compare=True: calls.append(factors) or score(factors, compare)
    w = measure_scales(bases, evaluator, min_rank=1)
    assert len(calls) == 4 and len(w.k) == len(w.v) == 2
    assert all(1 / CLIP <= x <= CLIP for x in w.k + w.v)
    assert all(c != 0 for c in w.cost_k + w.cost_v)  # a real, measured NLL change per layer
