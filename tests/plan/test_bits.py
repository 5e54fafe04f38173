"""Bits per rotated dim (plan/bits.py): the discrete reverse water-filling and what it plans."""

import pytest
import torch

from kvfold.factors import LayerBasis
from kvfold.plan.bits import KEY_MIN_BITS, BitRule, dim_bits, plan_bits, theta_for_mean_bits

WIDTHS = (0, 2, 3, 4, 5, 6, 8, 16)


def _cost(bits, lam, theta):
    """Distortion + θ·(code bits + scale bits of each band below 16 bits): what dim_bits minimises (one-byte
    scales)."""
    bands = {b for b in bits if 0 < b < 16}
    codes = sum(x * 2.0 ** (-2 * b) + theta * b for x, b in zip(lam, bits, strict=True))
    return codes + theta * 8 * len(bands)


def test_the_widths_minimise_distortion_plus_theta_per_code_and_scale_bit():
    from itertools import combinations_with_replacement

    spectrum = torch.tensor([3.0, 1.0, 0.5, 0.3, 0.1, 0.02], dtype=torch.float64)
    lam = (spectrum**2 / (spectrum**2).sum()).tolist()
    every = [sorted(c, reverse=True) for c in combinations_with_replacement(WIDTHS, len(lam))]  # non-increasing
    for theta in (1e-7, 1e-5, 1e-4, 1e-3, 1e-2, 0.1):
        bits = dim_bits(spectrum, theta, WIDTHS)
        assert bits == sorted(bits, reverse=True)
        assert _cost(bits, lam, theta) == pytest.approx(min(_cost(b, lam, theta) for b in every), rel=1e-12)
    wide = torch.logspace(0, -3, 64, dtype=torch.float64)
    means = [sum(dim_bits(wide, t, WIDTHS)) / 64 for t in (1e-14, 1e-6, 1e-4, 1e-2, 1.0)]
    assert means == sorted(means, reverse=True) and means[0] == 16 and means[-1] == 0
    assert dim_bits(torch.zeros(4), 1e-3, WIDTHS) == [0, 0, 0, 0]


def _bases(layers=2, kv_heads=2, d=16):
    torch.manual_seed(0)
    spec = torch.logspace(0, -2, d, dtype=torch.float64).repeat(kv_heads, 1) * torch.rand(kv_heads, 1)
    eye = torch.eye(d, dtype=torch.float64).repeat(kv_heads, 1, 1)
    return [LayerBasis(1, spec, spec.flip(-1).sort(-1, descending=True).values, eye, eye, eye, None)
            for _ in range(layers)]


def test_a_plan_keeps_the_dims_with_bits_and_layer_multipliers_scale_theta():
    bases = _bases()
    plan = plan_bits(bases, BitRule(1e-5, 1e-3, WIDTHS, layer_k=(1.0, 8.0), layer_v=(1.0, 1.0)))
    ranks = plan.ranks()
    assert ranks.d_k == [[sum(b > 0 for b in h) for h in layer] for layer in plan.k_bits]
    assert sum(map(sum, plan.k_bits[1])) < sum(map(sum, plan.k_bits[0]))  # multiplier 8: a cheaper layer
    assert plan.v_bits[0] == plan.v_bits[1]
    for bits in (2.0, 4.0, 6.0):
        theta = theta_for_mean_bits(bases, bits, WIDTHS)
        got = plan_bits(bases, BitRule(theta, theta, WIDTHS)).mean_bits()
        # the most bits within the budget; a band opening moves several dims at once, so not exactly it
        assert bits - 0.75 <= got <= bits



def test_keys_are_never_dropped_nor_stored_below_4_bits_values_may_be():
    # a θ so large that the water-filling would drop every dim of a head: keys keep KEY_MIN_BITS (4)
    plan = plan_bits(_bases(), BitRule(10.0, 10.0, WIDTHS))
    assert KEY_MIN_BITS == 4
    assert {b for layer in plan.k_bits for head in layer for b in head} == {KEY_MIN_BITS}
    # widths offering nothing as wide: keys take the widest there is
    narrow = plan_bits(_bases(), BitRule(10.0, 10.0, (0, 2, 3)))
    assert {b for layer in narrow.k_bits for head in layer for b in head} == {3}
    assert {b for layer in plan.v_bits for head in layer for b in head} == {0}


def test_band_mixing_is_orthonormal_folds_exactly_and_shrinks_a_bands_absmax():
    from kvfold.plan.bits import band_mixer, bit_factors
    from kvfold.plan.ranks import factors_for

    for n in (1, 2, 5, 32):
        m = band_mixer(n)
        assert torch.allclose(m.T @ m, torch.eye(n, dtype=torch.float64), atol=1e-12)
    bases = _bases()
    plan = plan_bits(bases, BitRule(1e-3, 1e-3, WIDTHS))
    mixed, plain = bit_factors(bases, plan), factors_for(bases, plan.ranks())
    for f, g in zip(mixed, plain, strict=True):  # what attention computes is unchanged: A Bᵀ, A_v B_hᵀ
        for h in range(len(f.qk_a)):
            kv = h // f.group
            assert torch.allclose(f.qk_a[h] @ f.qk_b[kv].T, g.qk_a[h] @ g.qk_b[kv].T, atol=1e-12)
            assert torch.allclose(f.v_a[kv] @ f.o_b[h].T, g.v_a[kv] @ g.o_b[h].T, atol=1e-12)
    assert any(not torch.equal(f.qk_b[0], g.qk_b[0]) for f, g in zip(mixed, plain, strict=True))
    # 16-bit bands are left as they are (exactness at full precision)
    wide = plan_bits(bases, BitRule(1e-14, 1e-14, WIDTHS))
    assert all(b == 16 for layer in wide.k_bits for h in layer for b in h)
    assert all(torch.equal(a, b) for f, g in zip(bit_factors(bases, wide), factors_for(bases, wide.ranks()),
                                                  strict=True) for a, b in zip(f.qk_b, g.qk_b, strict=True))
    # one band of dims with falling variances: mixed, its absmax over its RMS falls, and so does the error
    # of the same 4-bit quantizer
    from kvfold_runtime.bands import Band, roundtrip

    torch.manual_seed(0)
    x = torch.randn(4096, 16, dtype=torch.float64) * torch.logspace(0, -1, 16, dtype=torch.float64)
    band = (Band(0, 16, 4),)
    y = x @ band_mixer(16)
    assert float((y.abs().amax(-1) / y.norm(dim=-1)).mean()) < 0.8 * float((x.abs().amax(-1) / x.norm(dim=-1)).mean())
    err_plain = (roundtrip(x.float(), band) - x.float()).pow(2).mean()
    err_mixed = ((roundtrip(y.float(), band) - y.float()).double() @ band_mixer(16).T).pow(2).mean()
    assert err_mixed < 0.8 * err_plain


# Aligned bands (issue 50): every band of a head starts and ends on a multiple of BitRule.align dims.


def _chunks_hold_one_width(bits: list[int], align: int) -> bool:
    return all(len(set(bits[c : c + align])) == 1 for c in range(0, len(bits), align))


def _random_bases(d: int, layers: int = 2, kv_heads: int = 3, seed: int = 0) -> list[LayerBasis]:
    """Random descending spectra spanning 1 to 10^-(1..5) (keys and values apart), identity rotations."""
    g = torch.Generator().manual_seed(seed)

    def spectra():
        decay = 1 + 4 * torch.rand(kv_heads, 1, generator=g, dtype=torch.float64)
        s = torch.rand(kv_heads, d, generator=g, dtype=torch.float64) * 10 ** (-decay * torch.linspace(0, 1, d))
        return s.sort(-1, descending=True).values

    eye = torch.eye(d, dtype=torch.float64).repeat(kv_heads, 1, 1)
    return [LayerBasis(1, spectra(), spectra(), eye, eye, eye, None) for _ in range(layers)]


@pytest.mark.parametrize("d", [64, 128])
def test_aligned_widths_are_constant_on_each_16_dim_chunk_for_keys_and_values(d):
    bases = _random_bases(d)
    rule = BitRule(1.0, 1.0)
    assert rule.align == 16  # the default: export's (formats/bits.ALIGN)
    heads = ((1.0, 0.125, 8.0), (2.0, 1.0, 0.5))  # the sensitivity allocation's per-head multipliers keep it too
    seen = set()
    for theta in (1e-9, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0):
        for extra in ({}, {"head_k": heads, "head_v": heads[::-1]}, {"layer_k": (1.0, 4.0)}):
            plan = plan_bits(bases, BitRule(theta, 32 * theta, WIDTHS, **extra))
            for side in (plan.k_bits, plan.v_bits):
                for head in (h for layer in side for h in layer):
                    assert len(head) == d and head == sorted(head, reverse=True) and set(head) <= set(WIDTHS)
                    assert _chunks_hold_one_width(head, 16) and sum(b > 0 for b in head) % 16 == 0
                    seen.add(tuple(head))
            assert min(b for layer in plan.k_bits for h in layer for b in h) >= KEY_MIN_BITS  # keys: never dropped
            assert all(r % 16 == 0 for side in (plan.ranks().d_k, plan.ranks().d_v) for row in side for r in row)
    assert len({len(set(h)) for h in seen} - {1}) >= 2  # heads of several bands, not just one width each
    for bits in (3.0, 4.25, 6.0):  # the search by budget keeps the alignment (and stays within the budget)
        theta = theta_for_mean_bits(bases, bits, WIDTHS, 32.0)
        plan = plan_bits(bases, BitRule(theta, 32 * theta, WIDTHS))
        assert plan.mean_bits() <= bits
        heads = [h for side in (plan.k_bits, plan.v_bits) for layer in side for h in layer]
        assert all(_chunks_hold_one_width(h, 16) for h in heads)


def test_aligned_widths_minimise_the_same_cost_over_chunks():
    """align a: the exact minimum of dim_bits' cost among non-increasing widths constant on chunks of a dims
    (brute force over every such sequence); align 1 is the per-dim programme, checked against brute force above."""
    from itertools import combinations_with_replacement

    spectrum = torch.tensor([3.0, 2.5, 1.0, 0.6, 0.5, 0.3, 0.1, 0.02], dtype=torch.float64)
    lam = (spectrum**2 / (spectrum**2).sum()).tolist()
    for align in (2, 4):
        every = [[w for w in sorted(c, reverse=True) for _ in range(align)]
                 for c in combinations_with_replacement(WIDTHS, len(lam) // align)]
        for theta in (1e-7, 1e-5, 1e-4, 1e-3, 1e-2, 0.1):
            bits = dim_bits(spectrum, theta, WIDTHS, align=align)
            assert _chunks_hold_one_width(bits, align) and bits == sorted(bits, reverse=True)
            assert _cost(bits, lam, theta) == pytest.approx(min(_cost(b, lam, theta) for b in every), rel=1e-12)
    assert dim_bits(spectrum, 1e-4, WIDTHS, align=8) == [dim_bits(spectrum, 1e-4, WIDTHS, align=8)[0]] * 8
    assert dim_bits(torch.zeros(32), 1e-3, WIDTHS, align=16) == [0] * 32


@pytest.mark.parametrize("d", [64, 128])
def test_aligned_distortion_is_at_least_the_unaligned_at_equal_bits(d):
    """The aligned widths are one choice among the unaligned programme's, so (a) at every θ the aligned plan's cost
    is at least the unaligned one's, and (b) an aligned plan's modelled distortion at its bits (code + scale bits)
    lies on or above the unaligned plans' lower convex hull: D_a ≥ max over θ of [J_u(θ) − θ·R_a]."""
    from kvfold.plan.bits import modelled_distortion

    g = torch.Generator().manual_seed(1)
    thetas = [10 ** (e / 4) for e in range(-40, 1)]
    for _ in range(4):
        decay = 1 + 4 * float(torch.rand(1, generator=g))
        spectrum = (torch.rand(d, generator=g, dtype=torch.float64) * 10 ** (-decay * torch.linspace(0, 1, d))
                    ).sort(descending=True).values

        def rate_and_distortion(bits, spectrum=spectrum):
            rate = sum(bits) + 8 * len({b for b in bits if 0 < b < 16})
            return rate, modelled_distortion(spectrum, bits)

        loose = [rate_and_distortion(dim_bits(spectrum, t, WIDTHS)) for t in thetas]
        for t, (r_u, d_u) in zip(thetas, loose, strict=True):
            r_a, d_a = rate_and_distortion(dim_bits(spectrum, t, WIDTHS, align=16))
            assert d_a + t * r_a >= d_u + t * r_u - 1e-15
            bound = max(du + s * (ru - r_a) for s, (ru, du) in zip(thetas, loose, strict=True))
            assert d_a >= bound - 1e-15


def test_a_head_dim_not_a_multiple_of_the_alignment_is_one_clear_error():
    from kvfold.errors import KVFoldError

    message = r"head_dim 24 is not a multiple of the bits format's band alignment 16: export with --band-align 1"
    with pytest.raises(KVFoldError, match=message):
        dim_bits(torch.ones(24, dtype=torch.float64), 1e-3, WIDTHS, align=16)
    with pytest.raises(KVFoldError, match=message):
        plan_bits(_bases(d=24), BitRule(1e-3, 1e-3, WIDTHS))
    assert len(plan_bits(_bases(d=24), BitRule(1e-3, 1e-3, WIDTHS, align=8)).k_bits[0][0]) == 24
    with pytest.raises(KVFoldError, match="band alignment 0"):
        dim_bits(torch.ones(16, dtype=torch.float64), 1e-3, WIDTHS, align=0)
