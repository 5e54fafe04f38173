"""The frontier's long-context pieces (issue 51): whole sink and recent tokens, scoring from a position on, OSCAR as its
authors run it and OSCAR's quantizer in kvfold's bases."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvfold.errors import KVFoldError
from kvfold.hooks import AttentionPatch, patched
from kvfold_bench.frontier.methods import METHODS, get_methods
from tests.bench.conftest import close, frontier_logits


def test_a_method_with_sinks_and_a_recent_window_whole(setup):
    """NAME:sSwW (issue 51): the method's patches with the first S and each query's last W tokens whole, its bytes
    (S + W + (T − S − W)·f)/T at the scored context; a window as long as the context gives the original's logits
    back, a shorter one sits between the original and the method alone; a projection method is refused."""
    from kvfold_bench.frontier.methods.recent import Recent, fraction_at

    (alone,) = METHODS["int4"].candidates(setup)
    (m,) = get_methods(["int4:s4w16"])
    assert isinstance(m, Recent) and m.name == "int4:s4w16" and m.inner == METHODS["int4"]
    (cand,) = m.candidates(setup)
    t = setup.context
    assert cand.kv_fraction == pytest.approx((20 + (t - 20) * alone.kv_fraction) / t)
    assert cand.kv_fraction_32k == pytest.approx((20 + 32748 * alone.kv_fraction) / 32768)
    assert alone.kv_fraction_32k is None  # a method whose bytes do not depend on the context
    assert fraction_at(32768, 64, 256, 0.125) == pytest.approx((320 + 32448 * 0.125) / 32768)
    ref = frontier_logits(setup)
    (whole,) = Recent(METHODS["int4"], 0, t).candidates(setup)
    assert close(frontier_logits(setup, whole.patches), ref, 1e-4)
    err = (frontier_logits(setup, cand.patches) - ref).abs().mean()
    assert 0 < err < (frontier_logits(setup, alone.patches) - ref).abs().mean()
    (bits,) = get_methods(["kvfold-bits:s64w256@3,2.5"])
    assert bits.inner.grid == (3.0, 2.5) and bits.name == "kvfold-bits:s64w256"
    # kvfold-bits attends in its rotated basis: its whole tokens are its own k' and v' unrounded (compressed's
    # `whole`), so a window over every token gives the plan's dims without their rounding
    low = replace(METHODS["kvfold-bits"], grid=(4.0,))
    (coded,), (windowed,) = low.candidates(setup), Recent(low, 0, t).candidates(setup)
    unrounded = {i: AttentionPatch(before=p.whole, after=p.after) for i, p in coded.patches.items()}
    assert close(frontier_logits(setup, windowed.patches), frontier_logits(setup, unrounded), 1e-4)
    assert not close(frontier_logits(setup, coded.patches), frontier_logits(setup, unrounded), 1e-3)
    with pytest.raises(KVFoldError, match="is a rank method"):
        list(Recent(METHODS["kvfold"], 4, 16).candidates(setup))
    with pytest.raises(KVFoldError, match="changes the projections"):
        next(Recent(METHODS["palu"], 4, 16).candidates(setup))


def test_long_context_scoring_counts_positions_from_score_from(setup):
    """score_model(start=): only each window's tokens from `start` on are scored, the reference kept alike."""
    from kvfold.measure.evaluate import Reference, score_model

    ref = Reference([], [])
    late = score_model(setup.model, setup.windows, setup.batch, keep=ref, start=100)
    assert late.window_tokens == tuple(len(s) - 100 for s in setup.windows.ids)
    again = score_model(setup.model, setup.windows, setup.batch, against=ref, start=100)
    assert again.kl == pytest.approx(0.0, abs=1e-9) and again.top1 == late.top1
    with pytest.raises(ValueError, match="longer than"):
        score_model(setup.model, setup.windows, setup.batch, start=setup.context)


def test_oscar_is_its_authors_int2_in_attention_aware_bases(setup):
    """OSCAR (methods/oscar.py): per layer, R_K = eigenvectors of the queries' mean q qᵀ times the Hadamard, R_V
    the same of the values' covariance weighted by each token's mean squared logit (recomputed here from the raw
    q, k, v of the calibration windows); keys and values rounded in those bases by the clipped asymmetric INT2
    (a row's codes on 4 levels, the largest |x| clipped), rotated back; the first 64 and last 256 tokens whole;
    bytes 2 bits a number + 32 per token and head."""
    from kvfold_bench.frontier.methods.oscar import CLIP_K, CLIP_V, OscarInt2, int2_roundtrip, rotations
    from kvfold_bench.frontier.methods.recent import fraction_at
    from kvfold_bench.frontier.methods.turboquant import hadamard

    d = setup.model.config.head_dim
    # the rounding: 4 levels per row, |x| clipped at its ⌊r·d⌋-th smallest, every value within half a step
    torch.manual_seed(0)
    x = torch.randn(3, 5, d) * torch.logspace(-1, 1, d)
    y = int2_roundtrip(x, CLIP_K)
    assert all(len(row.unique()) <= 4 for row in y.view(-1, d))
    thr = x.abs().sort(-1).values[..., int(CLIP_K * d), None]
    clipped = x.clamp(-thr, thr)
    step = (clipped.amax(-1, keepdim=True) - clipped.amin(-1, keepdim=True)) / 3
    assert torch.all((y - clipped).abs() <= step * 0.5 * 1.01)
    # the rotations, from q, k, v captured at every layer
    got = {}

    def capture(i):
        def before(q, k, v):
            got.setdefault(i, []).append((q.double(), k.double(), v.double()))
            return q, k, v
        return AttentionPatch(before=before)

    layers = len(setup.adapter.attention_modules(setup.model))
    with torch.inference_mode(), patched(setup.model, setup.adapter, {i: capture(i) for i in range(layers)}):
        for ids in setup.calib_sequences().ids:
            setup.model(ids[None])
    h = hadamard(d).double()
    for i, (r_k, r_v, mean) in enumerate(rotations(setup)):
        q = torch.cat([a for a, _, _ in got[i]], 2)  # [1, H, T, d]
        k = torch.cat([b for _, b, _ in got[i]], 2)
        v = torch.cat([c for _, _, c in got[i]], 2)
        h_kv = k.shape[1]
        assert torch.allclose(mean.double(), k[0].mean(1), atol=1e-5)
        groups = q[0].unflatten(0, (h_kv, -1))  # [H_kv, group, T, d]
        c_q = torch.einsum("hgtd,hgte->de", groups, groups) / (groups.shape[1] * groups.shape[2] * h_kv)
        c_s = 0
        for g in range(h_kv):
            own = groups[g].flatten(0, 1)
            w = torch.einsum("td,de,te->t", k[0, g], own.T @ own / own.shape[0], k[0, g])
            w = w / w.mean()
            c_s = c_s + (w[:, None] * v[0, g]).T @ v[0, g] / (w.shape[0] * h_kv)
        for r, c in ((r_k, c_q), (r_v, c_s)):
            assert torch.allclose(r.double() @ r.double().T, torch.eye(d, dtype=torch.float64), atol=1e-5)
            u = r.double() @ h  # H is its own inverse: the eigenvectors, ascending
            lam = torch.linalg.eigvalsh(c)
            assert torch.allclose(u.T @ c @ u, torch.diag(lam), atol=1e-6 * float(lam.abs().max()))
    (cand,) = METHODS["oscar"].candidates(setup)
    assert cand.kv_fraction == pytest.approx(fraction_at(setup.context, 64, 256, (2 * d + 32) / (16 * d)))
    assert cand.kv_fraction_32k == pytest.approx(fraction_at(32768, 64, 256, (2 * d + 32) / (16 * d)))
    r_k, r_v, mean = rotations(setup)[0]
    patch = cand.patches[0]
    assert patch.exact == (64, 256)
    _, k0, v0 = got[0][0]
    _, k1, v1 = patch.before(None, k0.float(), v0.float())
    assert torch.allclose(k1, int2_roundtrip(k0.float() @ r_k, CLIP_K) @ r_k.T, atol=1e-5)
    assert torch.allclose(v1, int2_roundtrip(v0.float() @ r_v, CLIP_V) @ r_v.T, atol=1e-5)
    # the diagnostic variant: keys less their calibration mean, rounded, the mean added back; values as OSCAR's
    (shifted,) = METHODS["oscar-shifted"].candidates(setup)
    _, k2, v2 = shifted.patches[0].before(None, k0.float(), v0.float())
    mu = mean[None, :, None, :]
    assert torch.allclose(k2, int2_roundtrip((k0.float() - mu) @ r_k, CLIP_K) @ r_k.T + mu, atol=1e-5)
    assert torch.equal(v2, v1) and shifted.kv_fraction == cand.kv_fraction
    # the tiny model's windows are 256 tokens, so OSCAR's 64 + 256 whole tokens cover every token: the original's
    # logits; with 4 + 64 whole, tokens over 64 back are rounded: between the original and INT2 everywhere
    ref = frontier_logits(setup)
    assert setup.context <= 256 and close(frontier_logits(setup, cand.patches), ref)
    (alone,) = OscarInt2().candidates(setup)
    short = {i: replace(p, exact=(4, 64)) for i, p in cand.patches.items()}
    err, rounded = ((frontier_logits(setup, p) - ref).abs().mean() for p in (short, alone.patches))
    assert 0.05 * rounded < err < rounded


def test_kvfold_int2_is_oscars_int2_in_kvfolds_bases(setup):
    """kvfold-int2 (methods/int2.py): each token's keys less kvfold's key shift, in kvfold's key basis B_g, then the
    Hadamard, rounded by OSCAR's INT2 and mapped back by H and B_g⁻¹; values alike in A_v; OSCAR's whole tokens and
    bytes."""
    from kvfold_bench.frontier.methods.oscar import CLIP_K, CLIP_V, int2_roundtrip
    from kvfold_bench.frontier.methods.recent import fraction_at
    from kvfold_bench.frontier.methods.turboquant import hadamard

    d = setup.model.config.head_dim
    (cand,) = METHODS["kvfold-int2"].candidates(setup)
    assert cand.kv_fraction == pytest.approx(fraction_at(setup.context, 64, 256, (2 * d + 32) / (16 * d)))
    basis = setup.bases("aware", "text")[1]
    patch = cand.patches[1]
    assert patch.exact == (64, 256)
    torch.manual_seed(0)
    h_kv = basis.qk_b.shape[0]
    k, v = torch.randn(1, h_kv, 7, d) * 3, torch.randn(1, h_kv, 7, d)
    _, k1, v1 = patch.before(None, k, v)
    h, b, a = hadamard(d).double(), basis.qk_b.double(), basis.v_a.double()
    mu = (basis.k_mean if basis.k_mean is not None else torch.zeros(h_kv, d)).double()
    # a row's scale and zero are float16: the method's float32 projection and this float64 one can round them an ulp
    # apart (2⁻¹¹ relative: 0.0024 measured on one CPU), far below a wrong basis's or clip's error (order 1)
    for g in range(h_kv):
        y = int2_roundtrip((k[0, g].double() - mu[g]) @ b[g] @ h, CLIP_K)
        assert torch.allclose(k1[0, g].double(), y @ h @ torch.linalg.inv(b[g]) + mu[g], atol=1e-2)
        y = int2_roundtrip(v[0, g].double() @ a[g] @ h, CLIP_V)
        assert torch.allclose(v1[0, g].double(), y @ h @ torch.linalg.inv(a[g]), atol=1e-2)
    # the rounding is real: the rounded keys differ from the originals, and the model's logits move where tokens are
    # rounded (the tiny model's 256-token windows lie inside 64 + 256 whole tokens; 4 + 64 leave most rounded)
    assert not torch.allclose(k1, k, atol=1e-2)
    short = {i: replace(p, exact=(4, 64)) for i, p in cand.patches.items()}
    assert (frontier_logits(setup, short) - frontier_logits(setup)).abs().mean() > 1e-3


def test_kvfold_int2_orth_rounds_keys_in_the_polar_factor_of_kvfolds_key_basis(setup):
    """kvfold-int2-orth: B_g = U·S·Vᵀ replaced by U·Vᵀ (orthonormal, so the rounded keys map back by its transpose);
    values as kvfold-int2's."""
    from kvfold_bench.frontier.methods.oscar import CLIP_K, int2_roundtrip
    from kvfold_bench.frontier.methods.turboquant import hadamard

    d = setup.model.config.head_dim
    (orth,), (plain,) = METHODS["kvfold-int2-orth"].candidates(setup), METHODS["kvfold-int2"].candidates(setup)
    basis = setup.bases("aware", "text")[1]
    h_kv = basis.qk_b.shape[0]
    torch.manual_seed(0)
    k, v = torch.randn(1, h_kv, 7, d) * 3, torch.randn(1, h_kv, 7, d)
    _, k1, v1 = orth.patches[1].before(None, k, v)
    _, k2, v2 = plain.patches[1].before(None, k, v)
    mu = (basis.k_mean if basis.k_mean is not None else torch.zeros(h_kv, d)).double()
    h = hadamard(d).double()
    for g in range(h_kv):
        u, _, vh = torch.linalg.svd(basis.qk_b[g].double())
        r = u @ vh
        assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-8)
        y = int2_roundtrip((k[0, g].double() - mu[g]) @ r @ h, CLIP_K)
        assert torch.allclose(k1[0, g].double(), y @ h @ r.T + mu[g], atol=1e-4)
    assert torch.allclose(v1, v2) and not torch.allclose(k1, k2)
    assert orth.kv_fraction == plain.kv_fraction


def test_kvfold_gain_rounds_each_band_at_a_gaussian_step_of_one_gain_a_row(setup):
    """kvfold-gain (methods/gain.py): a unit Gaussian through one b-bit band at g = 1 has Max's squared error; a row's
    gain is its normalised root mean square as a log8 byte; values past the outermost level clip to it; the bytes
    are the bands' codes plus one byte a row (none without the gain); keys stay ≥ 4 bits unless key_min says 2."""
    from kvfold_bench.frontier.methods.gain import STEP, gain_roundtrip
    from kvfold_runtime.bands import Band

    torch.manual_seed(0)
    x = torch.randn(20000, 16)
    max_error = {2: 0.1188, 3: 0.03744, 4: 0.01154}  # Max 1960, table II
    for bits, want in max_error.items():
        y = gain_roundtrip(x, (Band(0, 16, bits),), torch.ones(16), gain=False)
        assert ((x - y) ** 2).mean().item() == pytest.approx(want, rel=0.03)
    row = torch.tensor([[3.0, -3.0, 3.0, -3.0, 100.0, 0.0, 0.0, 0.0]])
    rms = torch.tensor([3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0])
    out = gain_roundtrip(row, (Band(0, 4, 2), Band(4, 4, 16)), rms)
    assert out[0, 4:].tolist() == [100.0, 0.0, 0.0, 0.0]  # a 16-bit band is float16, outside the gain
    g = 1.0  # y = ±1 over the coded dims: gain 1, step STEP[2]; ±1 rounds to ±1.5 steps
    assert torch.allclose(out[0, :4], torch.tensor([1.5, -1.5, 1.5, -1.5]) * STEP[2] * g * 3)
    clipped = gain_roundtrip(torch.tensor([[50.0, 0.1, 0.1, 0.1]]), (Band(0, 4, 2),), torch.ones(4), gain=False)
    assert clipped[0, 0].item() == pytest.approx(1.5 * STEP[2])

    d = setup.model.config.head_dim
    method = replace(METHODS["kvfold-gain"], grid=(3.0,))
    (cand,) = method.candidates(setup)
    (static,) = replace(METHODS["kvfold-gain-static"], grid=(3.0,)).candidates(setup)
    layers = len(setup.bases("aware", "text"))
    h_kv = setup.bases("aware", "text")[0].qk_b.shape[0]
    rows = layers * h_kv * 2
    assert cand.kv_fraction - static.kv_fraction == pytest.approx(rows / (rows * 2 * d))  # one byte a row
    ref = frontier_logits(setup)
    moved = (frontier_logits(setup, cand.patches) - ref).abs().mean()
    assert moved > 1e-3
    plan = method._plan(setup.bases("aware", "text"), 1e-2, 8)
    assert min(b for layer in plan.k_bits for head in layer for b in head) >= 4
    low = replace(method, key_min=2)._plan(setup.bases("aware", "text"), 1e-2, 8)
    assert min(b for layer in low.k_bits for head in layer for b in head) < 4
    assert all(b in (0, 2, 3, 4, 5, 6, 8, 16) for layer in low.v_bits for head in layer for b in head)
