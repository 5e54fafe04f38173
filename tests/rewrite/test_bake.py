"""Acceptance 1 of export: full rank reproduces the original logits through the baked weights; at
reduced rank the baked weights compute exactly what the search scored."""

import types

import pytest
import torch

from kvfold.adapters import HeadLayout, get_adapter
from kvfold.factors import METHODS, get_method
from kvfold.factors.weights import o_proj_heads
from kvfold.hooks import patched
from kvfold.measure.evaluate import _patch
from kvfold.rewrite.bake import bake
from tests.conftest import TINY_CONFIGS, VOCAB, build_tiny
from tests.factors.test_factors import tiny_stats
from tests.reference import padded_forward


def _factors(model, arch, method, d_k, d_v):
    stats = tiny_stats(model, arch)
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    return [get_method(method).basis(stats, i, o_proj_heads(model, adapter, i)).truncate(d_k[i], d_v[i])
            for i in range(layout.num_layers)]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_full_rank_bake_reproduces_logits(arch, method):
    model = build_tiny(arch)
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    full = [[layout.head_dim] * layout.num_kv_heads] * layout.num_layers
    baked = bake(model, adapter, _factors(model, arch, method, full, full))
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        with padded_forward(baked, adapter, full, full):
            got = baked(input_ids=ids).logits
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_reduced_rank_bake_equals_the_scored_candidate(arch):
    model = build_tiny(arch)
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    d = layout.head_dim
    # uneven ranks: every KV head and layer different
    d_k = [[d - 4 * ((i + g) % 3) for g in range(layout.num_kv_heads)] for i in range(layout.num_layers)]
    d_v = [[d - 4 * ((i + 2 * g + 1) % 3) for g in range(layout.num_kv_heads)] for i in range(layout.num_layers)]
    factors = _factors(model, arch, "aware", d_k, d_v)
    baked = bake(model, adapter, factors)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        exact = model(input_ids=ids).logits
        with patched(model, adapter, {i: _patch(f, torch.float32) for i, f in enumerate(factors)}):
            scored = model(input_ids=ids).logits
        with padded_forward(baked, adapter, d_k, d_v):
            got = baked(input_ids=ids).logits
    assert _rel(got, scored) < 1e-5
    assert _rel(scored, exact) > 1e-4  # the compression really changed something


def test_bake_leaves_the_original_untouched():
    model = build_tiny("LlamaForCausalLM")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = 16
    bake(model, get_adapter("LlamaForCausalLM"),
         _factors(model, "LlamaForCausalLM", "aware", [[8, 8]] * 2, [[8, 8]] * 2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.model.layers[0].self_attn.v_proj.weight.shape[0] == 2 * d


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_in_place_bake_holds_one_model(arch, monkeypatch):
    """What export bakes (issue 52): the model itself, no copy made; its projections are the copy's, bit for bit,
    and every other tensor keeps its storage."""
    model = build_tiny(arch)
    adapter = get_adapter(arch)
    d = HeadLayout.from_config(model.config).head_dim
    layers = HeadLayout.from_config(model.config)
    d_k = [[d - 4] * layers.num_kv_heads] * layers.num_layers
    factors = _factors(model, arch, "aware", d_k, d_k)
    want = bake(model, adapter, factors).state_dict()
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    monkeypatch.setattr("kvfold.rewrite.bake.copy", types.SimpleNamespace(deepcopy=lambda *a: pytest.fail("copied")))
    baked = bake(model, adapter, factors, in_place=True)
    assert baked is model
    got = baked.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    kept = {n for n, p in baked.named_parameters() if storage.get(n) == p.data_ptr()}
    projections = {n for n in storage if n not in kept}
    assert projections and all(any(p in n for p in ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj",
                                                      "out_proj", "qkv_proj", "dense")) for n in projections)
    assert len(projections) <= 8 * layers.num_layers  # q/k/v/o weights and biases, nothing else
