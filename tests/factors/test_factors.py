import itertools

import pytest
import torch

from kvfold.adapters import HeadLayout, get_adapter
from kvfold.calib.artifact import CalibHeader, CalibOptions, CalibStats, ModelIdentity
from kvfold.calib.run import collect
from kvfold.calib.tokens import random_sequences
from kvfold.factors import METHODS, get_method
from kvfold.factors.weights import o_proj_heads
from tests.conftest import TINY_CONFIGS, VOCAB, build_tiny


def tiny_stats(model, arch, tokens=512) -> CalibStats:
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    grams = collect(model, adapter, random_sequences(VOCAB, tokens, 64, seed=0), batch=4)
    header = CalibHeader(
        kvfold_version="test", torch_version="", transformers_version="",
        model=ModelIdentity(spec=arch, path="", architecture=arch, adapter=adapter.name, weights_sha256="",
                            **vars(layout)),
        options=CalibOptions(source="random", text=None, tokens=tokens, seq_len=64, batch=4, prune=0.0,
                             kmeans=None, seed=0, dtype="float32"),
        tokens=tokens, sequences=tokens // 64,
    )
    return CalibStats(header=header, grams=grams)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request):
    model = build_tiny(request.param)
    return request.param, model, tiny_stats(model, request.param)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_full_rank_factors_are_identity(tiny, method):
    arch, model, stats = tiny
    layout = HeadLayout.from_config(model.config)
    d = layout.head_dim
    for layer in range(layout.num_layers):
        basis = get_method(method).basis(stats, layer, o_proj_heads(model, get_adapter(arch), layer))
        f = basis.truncate([d] * layout.num_kv_heads, [d] * layout.num_kv_heads)
        eye = torch.eye(d, dtype=torch.float64).expand(layout.num_heads, d, d)
        torch.testing.assert_close(f.qk_projection(), eye, rtol=0, atol=1e-8)
        torch.testing.assert_close(f.o_projection(), eye, rtol=0, atol=1e-8)
        assert (basis.qk_spectrum[:, :-1] >= basis.qk_spectrum[:, 1:] - 1e-12).all()


def test_aware_truncation_error_shrinks_with_rank():
    """E(q·k − q A Bᵀ k)² on the calibration statistics falls monotonically with d_k, to 0 at full rank."""
    arch = "LlamaForCausalLM"
    model = build_tiny(arch)
    stats = tiny_stats(model, arch)
    basis = get_method("aware").basis(stats, 1, o_proj_heads(model, get_adapter(arch), 1))
    cq, ck = stats.gram(1, "q")[0], stats.gram(1, "k")[0]
    errors = []
    for r in range(0, 17, 4):
        p = basis.truncate([r, r], [16, 16]).qk_projection()[0]
        m = torch.eye(16, dtype=torch.float64) - p  # error of q ↦ q(I − P) kᵀ, expected over q and k
        errors.append(float(torch.trace(m.T @ cq @ m @ ck)))
    assert all(a > b for a, b in itertools.pairwise(errors)) and errors[-1] < 1e-12 * errors[0]


def test_aware_measures_each_value_axis_mean_square_and_the_bits_format_orders_by_it():
    """v_energy_j = E[(v A_v)_j²] from the values' own calibration Gram; bits_basis sorts the value axes by it
    (the bits format's price of a value's rounding error, plan/bits.py) and leaves attention unchanged."""
    from kvfold.plan.bits import bits_basis

    arch = "LlamaForCausalLM"
    model = build_tiny(arch)
    stats = tiny_stats(model, arch)
    basis = get_method("aware").basis(stats, 1, o_proj_heads(model, get_adapter(arch), 1))
    gv = stats.gram(1, "v")
    for g in range(basis.v_a.shape[0]):
        a = basis.v_a[g]
        torch.testing.assert_close(basis.v_energy[g], torch.diagonal(a.T @ gv[g] @ a), rtol=1e-10, atol=0)
    ordered = bits_basis(basis)
    assert ordered.v_energy is None and torch.equal(ordered.qk_b, basis.qk_b)
    for g in range(basis.v_a.shape[0]):
        want = basis.v_energy[g].sort(descending=True).values
        torch.testing.assert_close(ordered.v_spectrum[g] ** 2, want, rtol=1e-12, atol=0)
        # the same axes, reordered: each column of the new A_v is one of the old ones
        match = (ordered.v_a[g].T @ basis.v_a[g]).abs()
        torch.testing.assert_close(match.amax(-1), torch.ones(16, dtype=torch.float64), rtol=0, atol=1e-12)
    assert not torch.equal(ordered.v_a, basis.v_a)  # the output spectrum and the values' own order differ here
    d = basis.v_a.shape[-1]
    full = ordered.truncate([d] * 2, [d] * 2)  # at full rank, still exact
    torch.testing.assert_close(full.o_projection(), torch.eye(d, dtype=torch.float64).expand_as(full.o_projection()),
                               rtol=0, atol=1e-8)
    zack = get_method("zack").basis(stats, 1, o_proj_heads(model, get_adapter(arch), 1))
    assert zack.v_energy is None and bits_basis(zack) is zack
