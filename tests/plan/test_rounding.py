"""The bits format's sensitivity allocation (plan/rounding.py): each KV head's rounding measured alone, on the real
model code, and turned into θ multipliers."""

import pytest
import torch

from kvfold.adapters import get_adapter
from kvfold.calib.tokens import random_sequences
from kvfold.factors import get_method
from kvfold.factors.weights import o_proj_heads
from kvfold.measure.evaluate import Evaluator
from kvfold.plan.bits import BitRule, modelled_distortion, plan_bits
from kvfold.plan.rounding import CLIP, _alone, _one_head, _scales, measure_head_scales
from tests.conftest import VOCAB, build_tiny
from tests.factors.test_factors import tiny_stats
from tests.plan.test_bits import WIDTHS, _bases


def test_costlier_heads_get_smaller_multipliers_within_the_clip_and_noise_is_floored():
    w = _scales([[1.0, 0.5], [0.0, 1e-9], [100.0, 0.3]])
    assert w[1][0] == w[1][1]  # both under the floor (1% of the mean cost): equal
    assert w[1][0] > w[2][1] > w[0][1] > w[0][0] > w[2][0]
    assert max(max(layer) for layer in w) <= CLIP and min(min(layer) for layer in w) == pytest.approx(1 / CLIP)


def test_head_multipliers_change_only_their_head():
    bases = _bases()
    plain = plan_bits(bases, BitRule(1e-5, 1e-3, WIDTHS))
    scaled = plan_bits(bases, BitRule(1e-5, 1e-3, WIDTHS, head_k=((1.0, 1.0), (1.0, 8.0)),
                                      head_v=((0.125, 1.0), (1.0, 1.0))))
    assert scaled.k_bits[0] == plain.k_bits[0] and scaled.k_bits[1][0] == plain.k_bits[1][0]
    assert sum(scaled.k_bits[1][1]) < sum(plain.k_bits[1][1])  # multiplier 8: fewer bits
    assert sum(scaled.v_bits[0][0]) > sum(plain.v_bits[0][0])  # 1/8: more
    assert scaled.v_bits[0][1] == plain.v_bits[0][1] and scaled.v_bits[1] == plain.v_bits[1]


def test_modelled_distortion_is_what_the_water_filling_prices():
    spectrum = torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)  # λ̂ = 4/6, 1/6, 1/6
    assert modelled_distortion(spectrum, [4, 2, 0]) == pytest.approx(4 / 6 / 256 + 1 / 6 / 16 + 1 / 6)
    assert modelled_distortion(spectrum, [16, 16, 16]) < 1e-9


def test_a_probe_stores_one_head_of_one_side_and_leaves_the_rest_exact():
    bases = _bases()
    plan = plan_bits(bases, BitRule(1e-4, 1e-3, WIDTHS))
    one = _alone(plan, 1, "v", 0)
    assert one.v_bits[0][0] == plan.v_bits[1][0]
    assert one.v_bits[0][1] == [16] * 16 and one.k_bits[0] == [[16] * 16] * 2
    x = torch.randn(2, 2, 5, 8)
    y = _one_head(lambda h: h.round(), 1)(x)
    assert torch.equal(y[:, 0], x[:, 0]) and torch.equal(y[:, 1], x[:, 1].round())


def test_measure_head_scales_scores_each_head_of_each_side_once():
    model = build_tiny("LlamaForCausalLM")
    stats = tiny_stats(model, "LlamaForCausalLM")
    adapter = get_adapter("LlamaForCausalLM")
    bases = [get_method("aware").basis(stats, i, o_proj_heads(model, adapter, i)) for i in range(2)]
    evaluator = Evaluator(model, adapter, random_sequences(VOCAB, 256, 64, seed=3), replay=True)
    calls = []
    score = evaluator.score_patches
    evaluator.score_patches = lambda patches, compare=True: calls.append(set(patches)) or score(patches, compare)
    heads = len(bases[0].qk_spectrum)
    scales = measure_head_scales(bases, evaluator, v_scale=32.0)
    assert len(calls) == 2 * 2 * heads and all(len(layers) == 1 for layers in calls)  # one layer patched each time
    assert [len(layer) for layer in scales.k + scales.v] == [heads] * 4
    assert all(1 / CLIP <= w <= CLIP for layer in scales.k + scales.v for w in layer)
    assert all(c > 0 for layer in scales.cost_k + scales.cost_v for c in layer)  # a real KL for every head


def test_the_searched_rule_takes_head_or_layer_multipliers_as_recorded():
    """A bits export's sensitivity is per head since schema 1.9; a reused curve of an older bits export keeps its
    per-layer multipliers."""
    from kvfold.plan.planner import _rule
    from kvfold.plan.recipe import Recipe
    from kvfold.plan.rounding import HeadScales
    from kvfold.plan.sensitivity import LayerScales

    bits = Recipe(accuracy=0.99, format="bits", allocation="sensitivity", key_bits=4)  # as resolve() sets it
    heads = HeadScales(((1.0, 2.0),), ((0.5, 1.0),), ((1.0, 0.5),), ((2.0, 1.0),))
    tk, tv = _rule(bits, heads, 1e-4).head_thetas(0, 2)
    assert tk == pytest.approx([1e-4, 2e-4]) and tv == pytest.approx([bits.v_scale * 0.5e-4, bits.v_scale * 1e-4])
    layers = LayerScales((3.0,), (0.5,), (1.0,), (1.0,))
    assert _rule(bits, layers, 1e-4).thetas(0) == pytest.approx((3e-4, bits.v_scale * 0.5e-4))
    assert _rule(Recipe(accuracy=0.99, allocation="sensitivity"), layers, 0.01).layer_k == (3.0,)
