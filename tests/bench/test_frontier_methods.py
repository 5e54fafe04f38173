"""Each frontier method against its definition, on a tiny random Llama (GQA: 4 query / 2 KV heads)."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from kvfold.errors import KVFoldError
from kvfold.factors import get_method
from kvfold.factors.weights import o_proj_heads
from kvfold.measure.evaluate import _patch
from kvfold.plan.ranks import RankRule, factors_for, plan_ranks
from kvfold_bench.frontier.methods import METHODS, get_methods
from kvfold_bench.frontier.methods.palu import prerope_grams
from kvfold_bench.frontier.methods.think import channel_masks
from kvfold_bench.frontier.methods.vllm_kv import fp8_per_tensor_roundtrip
from kvfold_bench.frontier.patches import compressed, key_channel_mask
from tests.bench.conftest import close, frontier_logits

ARCH = "LlamaForCausalLM"


def test_palu_reconstructs_low_rank_keys_and_values_before_rope(setup):
    cands = list(METHODS["palu"].candidates(setup))
    assert [c.kv_fraction for c in cands] == sorted((c.kv_fraction for c in cands), reverse=True)
    cand = cands[-1]
    assert cand.kv_fraction < 1 and cand.proj_maps and not cand.patches
    # Definition: k_proj(x) ↦ k_proj(x) U_r U_rᵀ before RoPE = a model whose k_proj/v_proj weights are
    # P W (P = U_r U_rᵀ symmetric). Build that model independently and compare logits.
    grams = prerope_grams(setup.model, setup.adapter, setup.calib_sequences())
    folded = copy.deepcopy(setup.model)
    attns = setup.adapter.attention_modules(folded)
    kept = 0
    for (layer, kind), g in grams.items():
        n = g.shape[0]
        if (layer, kind) not in cand.proj_maps:
            kept += n
            continue
        p = cand.proj_maps[(layer, kind)](torch.eye(n))  # the map applied to the identity = P
        assert torch.allclose(p, p.T, atol=1e-6)
        rank = round(float(torch.trace(p)))
        assert torch.allclose(p @ p, p, atol=1e-5) and torch.linalg.matrix_rank(p) == rank < n
        kept += rank
        proj = getattr(attns[layer], setup.adapter.k_proj if kind == "k" else setup.adapter.v_proj)
        with torch.no_grad():
            proj.weight.copy_(p @ proj.weight)
    assert math.isclose(cand.kv_fraction, kept / sum(g.shape[0] for g in grams.values()))
    assert close(frontier_logits(setup, proj_maps=cand.proj_maps), frontier_logits(setup, model=folded))
    assert not close(frontier_logits(setup, proj_maps=cand.proj_maps), frontier_logits(setup), 1e-3)


def test_palu_at_full_rank_is_exact(setup):
    grams = prerope_grams(setup.model, setup.adapter, setup.calib_sequences())
    from kvfold.calib.spectrum import svd_from_gram
    from kvfold_bench.frontier.methods.palu import _projector

    maps = {key: _projector(svd_from_gram(g)[1], g.shape[0], torch.float32) for key, g in grams.items()}
    assert close(frontier_logits(setup, proj_maps=maps), frontier_logits(setup))


def test_fp8_roundtrip_is_e4m3_at_scale_one_saturating():
    """vLLM's default fp8 cache (scale 1.0): the nearest e4m3 value, ties to even, ±448 beyond. That vLLM writes
    these codes: tests/bench/test_vllm_kv_dtypes.py, against its own write kernel."""
    torch.manual_seed(0)
    x = torch.randn(4, 2, 64, 16) * torch.logspace(-3, 1, 16)  # five decades of magnitude
    y = fp8_per_tensor_roundtrip(x)
    # e4m3: 3 mantissa bits -> round-to-nearest error ≤ 2^-4 relative for normals; subnormals (below 2^-6) have a
    # fixed step of 2^-9, so their error is ≤ 2^-10: no scale stretches the range.
    assert torch.all((y - x).abs() <= 2**-4 * x.abs() + 2**-10)
    exact = torch.tensor([0.0, 1.0, -1.5, 2.25, 448.0, -448.0, 0.125, 2**-9])
    assert torch.equal(fp8_per_tensor_roundtrip(exact), exact)  # values on the e4m3 grid are kept
    # ties to even (17, 19, 2^-10), a carry into the next binade (124.3), saturation (no NaN from 464 up, nor inf)
    edge = torch.tensor([17.0, 19.0, 2**-10, 3 * 2**-11, 124.3, 460.0, 464.0, 1e4, -1e4, float("inf")])
    assert fp8_per_tensor_roundtrip(edge).tolist() == [16.0, 20.0, 0.0, 2**-9, 128.0, 448.0, 448.0, 448.0, -448.0,
                                                       448.0]
    for dtype in (torch.float16, torch.bfloat16):  # read back in the model's dtype, exactly
        assert fp8_per_tensor_roundtrip(x.to(dtype)).dtype == dtype
        assert torch.equal(fp8_per_tensor_roundtrip(x.to(dtype)).float(), fp8_per_tensor_roundtrip(x.to(dtype).float()))


def test_fp8_method_halves_the_bytes_and_perturbs_little(setup):
    (cand,) = METHODS["fp8"].candidates(setup)
    assert cand.kv_fraction == 0.5 and len(cand.patches) == len(setup.adapter.attention_modules(setup.model))
    q8, ref = frontier_logits(setup, cand.patches), frontier_logits(setup)
    # the random tiny model's keys and values are O(1) (largest 4.6), in e4m3's normal range at scale 1.0: the
    # 3-bit mantissa moves its logits by 10.2% of their largest (2026-12-01)
    assert not torch.equal(q8, ref) and close(q8, ref, 0.15)


def test_think_prunes_the_lowest_query_key_channels(setup):
    d = 4
    q = torch.diag_embed(torch.tensor([[1.0, 1, 1, 1], [4, 1, 1, 1], [1, 1, 9, 1], [1, 1, 1, 1.0]]))  # 4 q heads
    k = torch.diag_embed(torch.tensor([[1.0, 2, 3, 4], [4, 3, 2, 1.0]]))  # 2 KV heads, group of 2
    # scores: head 0: mean q² over its 2 query heads (2.5,1,1,1) × k → (2.5, 2, 3, 4); head 1: (1,1,5,1)·(4,3,2,1)
    mask = channel_masks(q, k, 0.5)
    assert mask.tolist() == [[0, 0, 1, 1], [1, 0, 1, 0]]
    assert channel_masks(q, k, 0.0).tolist() == [[1] * d] * 2
    qq, kk, vv = torch.randn(1, 4, 3, d), torch.randn(1, 2, 3, d), torch.randn(1, 2, 3, d)
    q2, k2, v2 = key_channel_mask(mask).before(qq, kk, vv)
    assert torch.equal(q2, qq) and torch.equal(v2, vv)
    assert torch.equal(k2, kk * mask[None, :, None, :])
    cands = list(METHODS["think"].candidates(setup))
    for c, ratio in zip(cands, METHODS["think"].grid, strict=True):
        head_dim = setup.model.config.head_dim
        assert c.kv_fraction == pytest.approx(1 - int(head_dim * ratio) / head_dim / 2)  # values are kept


def test_uniform_gives_every_head_the_same_rank_and_is_exact_at_full_rank(setup):
    d = setup.model.config.head_dim
    for cand in METHODS["uniform"].candidates(setup):
        assert cand.kv_fraction == pytest.approx(cand.knob / d)
    bases = setup.bases("aware", "text")
    full = plan_ranks(bases, RankRule(0.0, 0.0, multiple=1, min_rank=1))
    exact = {i: compressed(f, torch.float32) for i, f in enumerate(factors_for(bases, full))}
    assert close(frontier_logits(setup, exact), frontier_logits(setup))


def test_compressed_attention_equals_the_evaluators_projection(setup):
    """kvfold's frontier patch computes q' k'ᵀ and p v' B_hᵀ on the short tensors themselves; the export
    search's patch projects q and o instead. Same algebra, so the same logits at reduced ranks."""
    bases = setup.bases("aware", "text")
    factors = factors_for(bases, plan_ranks(bases, RankRule(0.1, 0.05, multiple=1, min_rank=1)))
    ours = frontier_logits(setup, {i: compressed(f, torch.float32) for i, f in enumerate(factors)})
    theirs = frontier_logits(setup, {i: _patch(f, torch.float32) for i, f in enumerate(factors)})
    assert close(ours, theirs, 1e-4) and not close(ours, frontier_logits(setup), 1e-3)
    seen = []
    spy = {i: compressed(f, torch.float32, lambda x: seen.append(x.shape) or x) for i, f in enumerate(factors)}
    assert close(frontier_logits(setup, spy), ours)  # an identity quantizer changes nothing...
    assert len(seen) == 2 * len(factors)  # ...and sees each layer's cached k' and v'


def test_kvfold_fp8_is_kvfold_with_its_cache_in_fp8(setup):
    plain, q8 = METHODS["kvfold"], METHODS["kvfold+fp8"]
    assert q8.origin == "fp8"
    assert (q8.factors, q8.calib, q8.allocation) == (plain.factors, plain.calib, plain.allocation)
    (a,) = replace(plain, grid=(0.02,)).candidates(setup)
    (b,) = replace(q8, grid=(0.02,)).candidates(setup)
    assert b.kv_fraction == pytest.approx(a.kv_fraction / 2)
    la, lb = frontier_logits(setup, a.patches), frontier_logits(setup, b.patches)
    # fp8's 3-bit mantissa moves the random tiny model's logits by ~10% of their largest (0.102 measured with
    # position-averaged factors and a dynamic scale, 2026-11-25; 0.103 at vLLM's scale 1.0, 2026-12-01); the rank
    # cut alone moves them 43%
    assert not torch.equal(la, lb) and close(la, lb, 0.15)


def test_zack_is_the_papers_method_as_published(setup):
    """Common rotations from random-token calibration, one removal rate for K, V and every head."""
    zack = METHODS["zack"]
    assert get_methods(["fdc"]) == [zack]  # either paper's name
    assert (zack.factors, zack.calib, zack.allocation, zack.v_scale) == ("zack", "random", "eq6", 1.0)
    assert setup.stats("random").header.options.source == "random"
    assert setup.stats("text").header.options.text == setup.calib_text == "wiki:calib"  # --calib-text's default
    bases = [get_method("zack").basis(setup.stats("random"), i, o_proj_heads(setup.model, setup.adapter, i))
             for i in range(setup.model.config.num_hidden_layers)]
    for cand, r in zip(zack.candidates(setup), zack.grid, strict=True):
        assert cand.kv_fraction == pytest.approx(1 - plan_ranks(bases, RankRule(r, r, 1, 1)).compression)


def test_ablations_change_one_choice_each():
    base = METHODS["kvfold"]
    changed = {
        "kvfold-shared-r": {"allocation"}, "kvfold-split-r": {"allocation", "v_scale"},
        "kvfold-random": {"calib"}, "kvfold-zdc": {"calib"},
    }
    fields = ("factors", "calib", "allocation", "v_scale", "fp8")
    for name, diff in changed.items():
        m = METHODS[name]
        assert {f for f in fields if getattr(m, f) != getattr(base, f)} == diff, name


def test_kvfold_bits_counts_the_band_bytes_and_is_near_exact_at_full_precision(setup):
    from kvfold.plan.bits import V_SCALE, BitRule, plan_bits, theta_for_mean_bits
    from kvfold_runtime.bands import bands_from_bits, row_bytes

    bits = METHODS["kvfold-bits"]
    cands = list(replace(bits, grid=(15.9, 4.0)).candidates(setup))
    assert [c.kv_fraction for c in cands] == sorted((c.kv_fraction for c in cands), reverse=True)
    # bytes: independently, every head's row bytes of a plan at the same budget, as export plans it by default
    # (eq6: no per-layer or per-head multipliers)
    bases = setup.bases("aware", "text")

    # the plan at 4 bits per number: its rows' bytes / fp16's (align: export's at the tiny model's head_dim 16)
    def bytes_share(align: int = 8, **heads) -> float:
        theta = theta_for_mean_bits(bases, 4.0, BitRule(1, 1).widths, V_SCALE, **heads, align=align)
        plan = plan_bits(bases, BitRule(theta, V_SCALE * theta, **heads, align=align))
        rows = [row_bytes(bands_from_bits(h)) for side in (plan.k_bits, plan.v_bits) for layer in side for h in layer]
        return sum(rows) / (len(rows) * 2 * plan.head_dim)

    assert cands[1].kv_fraction == pytest.approx(bytes_share())
    # the unaligned variant: bands anywhere (export --band-align 1), every other choice the default's
    unaligned = METHODS["kvfold-bits-unaligned"]
    assert (bits.align, unaligned.align) == (None, 1) and replace(unaligned, name=bits.name, label=bits.label) == \
        replace(bits, align=1)
    (loose,) = replace(unaligned, grid=(4.0,)).candidates(setup)
    assert loose.kv_fraction == pytest.approx(bytes_share(align=1))
    # at head_dim 16 a head aligned to 16 holds one width; at 5.5 bits per number the unaligned plan splits some head
    (split,), (whole,) = (replace(m, grid=(5.5,)).candidates(setup) for m in (unaligned, replace(bits, align=16)))
    assert split.kv_fraction != whole.kv_fraction
    # the K/V split variants: only θ_v / θ_k differs; at the same mean bits, more θ_v / θ_k, more key bits
    keys4, values4 = METHODS["kvfold-bits-keys4"], METHODS["kvfold-bits-values4"]
    assert (keys4.v_scale, values4.v_scale) == (4 * V_SCALE, V_SCALE / 4)
    assert replace(keys4, name=bits.name, label=bits.label, v_scale=V_SCALE) == bits

    def key_bits(v_scale: float) -> float:
        theta = theta_for_mean_bits(bases, 4.0, BitRule(1, 1).widths, v_scale, align=8)
        plan = plan_bits(bases, BitRule(theta, v_scale * theta, align=8))
        return sum(b for layer in plan.k_bits for head in layer for b in head)

    assert key_bits(V_SCALE / 4) <= key_bits(V_SCALE) < key_bits(4 * V_SCALE)  # the tiny model: keys floor at 4 bits
    # the per-head variant: the same budget with the rounding probes' multipliers (plan/rounding.py)
    scales = setup.head_scales()
    (per_head,) = replace(METHODS["kvfold-bits-heads"], grid=(4.0,)).candidates(setup)
    assert per_head.kv_fraction == pytest.approx(bytes_share(head_k=scales.k, head_v=scales.v))
    assert not torch.equal(frontier_logits(setup, per_head.patches), frontier_logits(setup, cands[1].patches))
    # nearly every dim at 16 bits (float16 storage): the original's logits up to float16 round-off
    assert close(frontier_logits(setup, cands[0].patches), frontier_logits(setup), 2e-2)
    assert not close(frontier_logits(setup, cands[1].patches), frontier_logits(setup), 1e-3)


def test_int_per_token_and_kivi_count_their_scales(setup):
    from kvfold_bench.frontier.methods.quant import kivi_roundtrip

    d = setup.model.config.head_dim
    (i8,), (i4,) = METHODS["int8"].candidates(setup), METHODS["int4"].candidates(setup)
    assert i8.kv_fraction == (d + 2) / (2 * d) and i4.kv_fraction == (d / 2 + 2) / (2 * d)
    ref = frontier_logits(setup)
    assert close(frontier_logits(setup, i8.patches), ref, 2e-2)
    assert not close(frontier_logits(setup, i4.patches), ref, 1e-3)
    (k4,) = METHODS["kivi4"].candidates(setup)
    groups = -(-d // 32)
    assert k4.kv_fraction == pytest.approx((2 * d * 4 / 8 + 4 * d / 32 + 4 * groups) / (4 * d))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 70, 40)  # 70 tokens: a partial key group; 40 channels: a partial value group
    for keys, dims in ((True, 2), (False, 3)):
        y = kivi_roundtrip(x, 4, keys)
        if keys:
            g = torch.nn.functional.pad(x, (0, 0, 0, 26), value=float("nan")).unflatten(2, (-1, 32))
            span = (g.nan_to_num(-1e9).amax(3) - g.nan_to_num(1e9).amin(3)).repeat_interleave(32, 2)[:, :, :70]
        else:
            g = torch.nn.functional.pad(x, (0, 24), value=float("nan")).unflatten(-1, (-1, 32))
            span = (g.nan_to_num(-1e9).amax(-1) - g.nan_to_num(1e9).amin(-1)).repeat_interleave(32, -1)[..., :40]
        step = span / 15
        assert torch.all((y - x).abs() <= step * 0.5 * 1.01 + 1e-3 * step.amax()), dims


def test_a_methods_grid_can_be_narrowed_for_a_focused_run():
    """NAME@v1,v2: the same method sweeping only those knob values, kept through the run's ordering; a method
    without a grid, or values that are not numbers, are refused in one line."""
    from kvfold_bench.frontier.run import _ordered

    bits, loose = get_methods(["kvfold-bits@4.5,4.25", "kvfold-bits-unaligned@4"])
    assert (bits.name, bits.grid, loose.name, loose.grid) == ("kvfold-bits", (4.5, 4.25), "kvfold-bits-unaligned",
                                                              (4.0,))
    assert bits == replace(METHODS["kvfold-bits"], grid=(4.5, 4.25))
    assert _ordered(["kvfold-bits@4.5", "kvfold+fp8"]) == ["kvfold-bits@4.5", "fp8", "kvfold+fp8"]
    for bad in ("int4_per_token_head@4", "kvfold-bits@", "kvfold-bits@four"):
        with pytest.raises(KVFoldError, match=r"knob grid"):
            get_methods([bad])
