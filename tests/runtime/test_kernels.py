"""The torch serving attention against the reference, on uneven per-head widths and every mask form."""

import pytest
import torch

from kvfold_runtime import reference_attention, sdpa_attention

D_K, D_V, GROUP = [12, 7, 16], [5, 16, 9], 2  # every KV head different, d_k ≠ d_v both ways


def _inputs(t, s, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, t, GROUP * sum(D_K), generator=g, dtype=dtype)
    k = torch.randn(2, s, sum(D_K), generator=g, dtype=dtype)
    v = torch.randn(2, s, sum(D_V), generator=g, dtype=dtype)
    return q, k, v


def _naive(q, k, v, mask):
    """Independent check of the reference: pad every head to 16 and run dense per-head math."""
    def heads(x, widths, rep):
        parts = [p for p in x.split(widths, -1) for _ in range(rep)]
        return torch.stack([torch.nn.functional.pad(p, (0, 16 - p.shape[-1])) for p in parts], 1)

    qh = heads(q, [w for w in D_K for _ in range(GROUP)], 1)
    kh, vh = heads(k, D_K, GROUP), heads(v, D_V, GROUP)
    scores = qh @ kh.transpose(-1, -2) * 0.3 + mask
    out = scores.softmax(-1) @ vh  # [B, H, T, 16]
    return torch.cat([out[:, h, :, : D_V[h // GROUP]] for h in range(GROUP * len(D_K))], -1)


def test_reference_matches_a_dense_padded_computation():
    q, k, v = _inputs(5, 9)
    causal = torch.full((5, 9), float("-inf"), dtype=torch.float64).triu(9 - 5 + 1)
    got = reference_attention(q, k, v, D_K, D_V, GROUP, scaling=0.3)
    torch.testing.assert_close(got, _naive(q, k, v, causal), rtol=1e-12, atol=1e-12)
    assert got.shape == (2, 5, GROUP * sum(D_V))


@pytest.mark.parametrize(("t", "s"), [(9, 9), (1, 9), (4, 9)])  # prefill, decode, chunked prefill
def test_sdpa_matches_reference_without_a_mask(t, s):
    q, k, v = _inputs(t, s)
    want = reference_attention(q, k, v, D_K, D_V, GROUP, scaling=0.25)
    torch.testing.assert_close(sdpa_attention(q, k, v, D_K, D_V, GROUP, scaling=0.25), want)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_matches_reference_with_a_padding_mask(kind):
    q, k, v = _inputs(6, 6, seed=1)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[0, :, :, :2] = False  # left padding of the first sequence
    keep[0, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # padded rows attend to themselves
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, -1e30)
    want = reference_attention(q, k, v, D_K, D_V, GROUP, scaling=0.2, mask=mask)
    torch.testing.assert_close(sdpa_attention(q, k, v, D_K, D_V, GROUP, scaling=0.2, mask=mask), want)


def test_softcap_is_applied():
    q, k, v = _inputs(4, 4, seed=2)
    capped = sdpa_attention(q * 5, k, v, D_K, D_V, GROUP, scaling=1.0, softcap=2.0)
    plain = sdpa_attention(q * 5, k, v, D_K, D_V, GROUP, scaling=1.0)
    assert not torch.allclose(capped, plain)
    torch.testing.assert_close(capped, reference_attention(q * 5, k, v, D_K, D_V, GROUP, scaling=1.0, softcap=2.0))
