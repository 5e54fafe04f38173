"""The paged torch path (what the vLLM backend runs) against the reference on the same tokens: scattered
blocks, several requests at once, decode batches, chunked prefill against a cached prefix, sliding windows."""

import pytest
import torch

from kvfold_runtime import paged_attention, reference_attention, write_paged

WIDTHS = {
    "uneven, d_k != d_v": ([5, 1, 7], [3, 8, 2]),
    "one head": ([4], [6]),
    "equal": ([8, 8], [8, 8]),
}


def _window_mask(t: int, s: int, window: int | None) -> torch.Tensor:
    q = torch.arange(s - t, s)[:, None]
    k = torch.arange(s)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed[None, None]


def _case(d_k, d_v, group, seq_lens, q_lens, block_size=4, seed=0, dtype=torch.float64):
    """A paged cache holding `seq_lens` tokens per request in shuffled blocks, and each request's last
    `q_lens` tokens as queries. Returns the paged inputs and, per request, its contiguous k, v, q."""
    g = torch.Generator().manual_seed(seed)
    sk, sv = sum(d_k), sum(d_v)
    blocks_per = [(s + block_size - 1) // block_size for s in seq_lens]
    order = torch.randperm(sum(blocks_per) + 3, generator=g)[: sum(blocks_per)] + 1  # block 0 stays unused
    kv = torch.full((int(order.max()) + 1, 1, block_size, sk + sv), float("nan"), dtype=dtype)
    table = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    seqs, queries, used = [], [], 0
    for r, s in enumerate(seq_lens):
        table[r, :blocks_per[r]] = order[used:used + blocks_per[r]]
        used += blocks_per[r]
        k = torch.randn(s, sk, generator=g, dtype=dtype)
        v = torch.randn(s, sv, generator=g, dtype=dtype)
        pos = torch.arange(s)
        slots = table[r, pos // block_size].long() * block_size + pos % block_size
        write_paged(kv, slots, k, v)
        seqs.append((k, v))
        queries.append(torch.randn(q_lens[r], group * sk, generator=g, dtype=dtype))
    start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return kv, table, torch.tensor(seq_lens), start, torch.cat(queries), seqs, queries


@pytest.mark.parametrize("widths", list(WIDTHS.values()), ids=list(WIDTHS))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_matches_reference(widths, group, window):
    d_k, d_v = widths
    # a mixed batch: two decodes, a fresh prefill, a chunked prefill against a cached prefix
    seq_lens, q_lens = [9, 1, 7, 13], [1, 1, 7, 4]
    kv, table, lens, start, q, seqs, queries = _case(d_k, d_v, group, seq_lens, q_lens)
    got = paged_attention(q, kv, table, lens, start, d_k, d_v, group, scaling=0.3, sliding_window=window)
    for r, ((k, v), qr) in enumerate(zip(seqs, queries, strict=True)):
        want = reference_attention(qr[None], k[None], v[None], d_k, d_v, group, scaling=0.3,
                                   mask=_window_mask(q_lens[r], seq_lens[r], window))[0]
        torch.testing.assert_close(got[start[r]:start[r + 1]], want, rtol=1e-10, atol=1e-10)


def test_padding_slots_are_not_written_and_nan_blocks_are_never_read():
    d_k, d_v = [3, 2], [1, 4]
    kv, table, lens, start, q, _, _ = _case(d_k, d_v, 2, [6, 3], [1, 3])
    before = kv.clone()
    write_paged(kv, torch.tensor([-1, -1]), torch.ones(2, 5, dtype=kv.dtype), torch.ones(2, 5, dtype=kv.dtype))
    assert torch.equal(kv.nan_to_num(7.0), before.nan_to_num(7.0))
    out = paged_attention(q, kv, table, lens, start, d_k, d_v, 2, scaling=1.0)
    assert out.shape == (4, 2 * sum(d_v)) and not out.isnan().any()


def test_float32_writes_into_the_output_buffer():
    d_k, d_v = [6, 2], [2, 6]
    kv, table, lens, start, q, _, _ = _case(d_k, d_v, 2, [5, 11], [5, 1], dtype=torch.float32)
    out = torch.empty(q.shape[0], 2 * sum(d_v))
    assert paged_attention(q, kv, table, lens, start, d_k, d_v, 2, scaling=0.5, out=out) is out


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_holds_one_byte_per_number_and_attends_on_its_codes(fp8):
    """vLLM's kv_cache_dtype="fp8": a uint8 cache of float8 codes of k / k_scale, v / v_scale. Attention on
    it equals the reference on the decoded values; the codes round-trip within the format's step."""
    d_k, d_v, group, bs = [5, 3], [2, 6], 2, 4
    g = torch.Generator().manual_seed(3)
    s, t = 11, 3
    k, v = torch.randn(s, sum(d_k), generator=g) * 3, torch.randn(s, sum(d_v), generator=g)
    kv = torch.zeros(4, 1, bs, sum(d_k) + sum(d_v), dtype=torch.uint8)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    pos = torch.arange(s)
    write_paged(kv, table[0, pos // bs].long() * bs + pos % bs, k, v, fp8=fp8, k_scale=0.5, v_scale=2.0)
    dk = ((k / 0.5).to(fp8).float() * 0.5)
    dv = ((v / 2.0).to(fp8).float() * 2.0)
    step = 2.0 ** -3 if fp8 == torch.float8_e4m3fn else 2.0 ** -2  # relative spacing of the mantissa
    assert ((dk - k).abs() <= step * k.abs() + 1e-2).all()
    q = torch.randn(t, group * sum(d_k), generator=g)
    got = paged_attention(q, kv, table, torch.tensor([s]), torch.tensor([0, t]), d_k, d_v, group, scaling=0.4,
                          fp8=fp8, k_scale=0.5, v_scale=2.0)
    want = reference_attention(q[None], dk[None], dv[None], d_k, d_v, group, scaling=0.4,
                               mask=_window_mask(t, s, None))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
