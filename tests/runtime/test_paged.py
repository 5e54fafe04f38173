"""The paged torch path (what the vLLM backend runs) against the reference on the same tokens: scattered
blocks, several requests at once, decode batches, chunked prefill against a cached prefix, sliding windows;
rows of numbers (model dtype, fp8) and of band codes (bits format)."""

import os
import shutil
import sys

import pytest
import torch

from kvfold_runtime import (
    BandRows,
    LayerDims,
    NumberRows,
    bands_from_bits,
    paged_attention,
    reference_attention,
    row_codec,
    write_paged,
)
from kvfold_runtime.bands import decode_heads, encode_heads
from kvfold_runtime.kernels import cpu_bits
from kvfold_runtime.kernels import paged as paged_module
from kvfold_runtime.kernels.dispatch import paged, paged_kernels_for

WIDTHS = {
    "uneven, d_k != d_v": ([5, 1, 7], [3, 8, 2]),
    "one head": ([4], [6]),
    "equal": ([8, 8], [8, 8]),
}


def _require_c_decoder() -> None:
    """Skip where no C compiler exists (or not on Linux, where the decoder is not built); where one exists, a
    failed build is a failure, not a skip: the C reader is the subject of the tests that call this."""
    if not sys.platform.startswith("linux") or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert cpu_bits.library() is not None, "a C compiler is here but building cpu_bits.c failed (see the warning)"


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
    codec = NumberRows(sum(d_k), fp8, k_scale=0.5, v_scale=2.0)
    write_paged(kv, table[0, pos // bs].long() * bs + pos % bs, k, v, codec=codec)
    dk = ((k / 0.5).to(fp8).float() * 0.5)
    dv = ((v / 2.0).to(fp8).float() * 2.0)
    step = 2.0 ** -3 if fp8 == torch.float8_e4m3fn else 2.0 ** -2  # relative spacing of the mantissa
    assert ((dk - k).abs() <= step * k.abs() + 1e-2).all()
    q = torch.randn(t, group * sum(d_k), generator=g)
    got = paged_attention(q, kv, table, torch.tensor([s]), torch.tensor([0, t]), d_k, d_v, group, scaling=0.4,
                          codec=codec)
    want = reference_attention(q[None], dk[None], dv[None], d_k, d_v, group, scaling=0.4,
                               mask=_window_mask(t, s, None))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _banded(d_k, d_v, group) -> LayerDims:
    """A bits-format layer: per head a band at 16, 8, 4 and 2 bits (what fits its width), float16 scales on one
    head to cover both scale formats."""
    def head(w, g):
        bits = ([16] * (w // 4) + [8] * (w // 4) + [4] * (w // 4) + [2] * w)[:w]
        return bands_from_bits(bits, "float16" if g == 1 else "log8")

    return LayerDims(tuple(d_k), tuple(d_v), group, tuple(head(w, g) for g, w in enumerate(d_k)),
                     tuple(head(w, g) for g, w in enumerate(d_v)))


@pytest.mark.parametrize("widths", list(WIDTHS.values()), ids=list(WIDTHS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("reader", ["c", "c-scalar", "torch"])
@pytest.mark.parametrize("bs", [4, 16, 20])  # 20: sixteen rows, then four, in one block (cpu_bits.c score_rows)
def test_bits_cache_holds_the_band_rows_and_attends_on_what_they_decode_to(widths, window, reader, bs, monkeypatch):
    """A bits-format layer's paged cache: uint8 rows of exactly LayerDims.row_bytes() = the export's bytes per
    token, each encode_heads(keys) ++ encode_heads(values); attention over it (decodes, a prefill, a chunked
    prefill) = the reference on decode_heads of those rows. Decodes read the codes in C (cpu_bits.c, where a
    compiler runs) or decode the rows in torch (`reader`); rows not written hold NaN bytes either way. Blocks of 16
    rows take the C reader's sixteen-row vector loops (vLLM's CPU block size is larger still)."""
    if reader == "torch":
        monkeypatch.setattr(paged_module, "library", lambda: None)
        monkeypatch.setattr(cpu_bits, "library", lambda: None)
    else:
        monkeypatch.setenv("KVFOLD_CPU_DECODER", reader)
        _require_c_decoder()
    d_k, d_v = widths
    group = 2
    dims = _banded(d_k, d_v, group)
    codec = row_codec(dims)
    assert isinstance(codec, BandRows)
    k_bytes, v_bytes = dims.row_bytes()
    seq_lens, q_lens = [9, 1, 7, 13, 45], [1, 1, 7, 4, 1]
    g = torch.Generator().manual_seed(5)
    n_blocks = sum((s + bs - 1) // bs for s in seq_lens)
    order = torch.randperm(n_blocks + 2, generator=g)[:n_blocks] + 1
    kv = torch.full((n_blocks + 3, 1, bs, k_bytes + v_bytes), 0xFF, dtype=torch.uint8)  # 0xFF 0xFF: a float16 NaN
    table = torch.zeros(len(seq_lens), max((s + bs - 1) // bs for s in seq_lens), dtype=torch.int32)
    used, seqs = 0, []
    for r, s in enumerate(seq_lens):
        per = (s + bs - 1) // bs
        table[r, :per] = order[used:used + per]
        used += per
        k, v = torch.randn(s, sum(d_k), generator=g) * 2, torch.randn(s, sum(d_v), generator=g)
        pos = torch.arange(s)
        slots = table[r, pos // bs].long() * bs + pos % bs
        write_paged(kv, slots, k, v, codec=codec)
        rows = kv.view(-1, k_bytes + v_bytes)[slots]
        assert torch.equal(rows, torch.cat([encode_heads(k, dims.d_k, dims.k_bands),
                                            encode_heads(v, dims.d_v, dims.v_bands)], -1))
        seqs.append((decode_heads(rows[:, :k_bytes], dims.d_k, dims.k_bands, torch.float32),
                     decode_heads(rows[:, k_bytes:], dims.d_v, dims.v_bands, torch.float32)))
    q = torch.randn(sum(q_lens), group * sum(d_k), generator=g)
    start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    got = paged(q, kv, table, torch.tensor(seq_lens), start, list(d_k), list(d_v), group, scaling=0.3,
                sliding_window=window, codec=codec)  # the dispatch vLLM calls: on CPU, the torch path
    assert paged_kernels_for(q, codec) == "torch" and not got.isnan().any()
    for r, (k, v) in enumerate(seqs):
        qr = q[start[r]:start[r + 1]]
        want = reference_attention(qr[None], k[None], v[None], list(d_k), list(d_v), group, scaling=0.3,
                                   mask=_window_mask(q_lens[r], seq_lens[r], window))[0]
        torch.testing.assert_close(got[start[r]:start[r + 1]], want, rtol=1e-5, atol=1e-5)


def test_bits_rows_are_written_from_the_model_dtype_and_padding_slots_are_skipped():
    dims = _banded([6, 3], [5, 8], 1)
    kv = torch.zeros(2, 1, 4, sum(dims.row_bytes()), dtype=torch.uint8)
    k, v = torch.randn(3, 9, dtype=torch.bfloat16), torch.randn(3, 13, dtype=torch.bfloat16)
    write_paged(kv, torch.tensor([5, -1, 2]), k, v, codec=BandRows(dims))
    rows = kv.view(-1, kv.shape[-1])
    assert torch.equal(rows[[5, 2]], BandRows(dims).encode(k[[0, 2]], v[[0, 2]], torch.uint8))
    assert not rows[[0, 1, 3, 4, 6, 7]].any()
    got_k, got_v = BandRows(dims).decode(rows[[5]], torch.bfloat16)
    assert got_k.dtype == got_v.dtype == torch.bfloat16 and got_k.shape == (1, 9) and got_v.shape == (1, 13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("reader", ["c", "c-scalar"])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("widths", ["uneven, d_k != d_v", "wider than a vector"])
def test_rank_cache_decodes_read_its_numbers_in_c(dtype, window, reader, bs, widths, monkeypatch):
    """A rank-format layer's cache (its numbers in the model's dtype): decode attention reads the blocks in C
    (cpu_bits.c's plain-number segments) and equals the reference on the stored numbers; prefills take torch's
    SDPA. Unwritten rows hold NaN and are never read. Float32 heads at least a vector wide (8 floats with AVX,
    16 with AVX-512) are read in place, whole vectors and an overlapping last one: widths that are and are not
    multiples of the vector, beside narrower heads decoded into a buffer."""
    monkeypatch.setenv("KVFOLD_CPU_DECODER", reader)
    _require_c_decoder()
    d_k, d_v = {"wider than a vector": ([19, 8, 37], [24, 9, 17])}.get(widths) or WIDTHS[widths]
    group = 6 if widths == "wider than a vector" else 3  # 6: the values' sums four queries at a time, then two
    seq_lens, q_lens = [9, 1, 7, 13, 45], [1, 1, 7, 4, 1]
    kv, table, lens, start, q, seqs, queries = _case(d_k, d_v, group, seq_lens, q_lens, block_size=bs, dtype=dtype)
    codec = row_codec(LayerDims(tuple(d_k), tuple(d_v), group))
    assert paged_module._reads_in_c(codec, q, kv.view(kv.shape[0], bs, -1))
    got = paged(q, kv, table, lens, start, d_k, d_v, group, scaling=0.3, sliding_window=window, codec=codec)
    assert got.dtype == dtype and not got.isnan().any()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for r, ((k, v), qr) in enumerate(zip(seqs, queries, strict=True)):
        want = reference_attention(qr[None].double(), k[None].double(), v[None].double(), d_k, d_v, group,
                                   scaling=0.3, mask=_window_mask(q_lens[r], seq_lens[r], window))[0]
        torch.testing.assert_close(got[start[r]:start[r + 1]].double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", ["bits", "rank float32", "rank float16"])
@pytest.mark.parametrize("reader", ["c", "c-scalar"])
def test_a_decode_step_reads_vllms_block_table_in_c_without_a_plan(fmt, reader, monkeypatch):
    """A step whose every request decodes one token, no window (vLLM's max_query_len 1): C reads the block table
    and lengths as vLLM passes them (int32 table wider than any request needs, a last block partly written, the
    rest of it NaN bytes), no StepPlan is built, and the output equals the planned path's bit for bit. Requests
    from one to many blocks: a long one alone takes the split into parts."""
    monkeypatch.setenv("KVFOLD_CPU_DECODER", reader)
    _require_c_decoder()
    d_k, d_v = [5, 12, 7], [3, 8, 17]
    group, bs = 3, 16
    seq_lens, q_lens = [1, 16, 17, 45, 130], [1] * 5
    dtype = torch.float16 if fmt == "rank float16" else torch.float32
    if fmt == "bits":
        dims = _banded(d_k, d_v, group)
        codec = row_codec(dims)
        g = torch.Generator().manual_seed(3)
        blocks_per = [(s + bs - 1) // bs for s in seq_lens]
        kv = torch.full((sum(blocks_per) + 4, 1, bs, sum(dims.row_bytes())), 0xFF, dtype=torch.uint8)
        table = torch.zeros(len(seq_lens), max(blocks_per) + 2, dtype=torch.int32)
        table[:, :] = -7  # columns past a request's blocks: never read
        order, used = torch.randperm(kv.shape[0] - 1, generator=g) + 1, 0
        for r, s in enumerate(seq_lens):
            table[r, :blocks_per[r]] = order[used:used + blocks_per[r]]
            used += blocks_per[r]
            pos = torch.arange(s)
            write_paged(kv, table[r, pos // bs].long() * bs + pos % bs, torch.randn(s, sum(d_k), generator=g),
                        torch.randn(s, sum(d_v), generator=g), codec=codec)
        lens, start = torch.tensor(seq_lens, dtype=torch.int32), torch.arange(len(seq_lens) + 1)
        q = torch.randn(len(seq_lens), group * sum(d_k), generator=g)
    else:
        kv, table, lens, start, q, _, _ = _case(d_k, d_v, group, seq_lens, q_lens, block_size=bs, dtype=dtype)
        codec = row_codec(LayerDims(tuple(d_k), tuple(d_v), group))
    planned = paged(q, kv, table, lens, start, d_k, d_v, group, scaling=0.3, codec=codec)

    def no_plan(*args, **kwargs):
        raise AssertionError("a decode step read in C builds no StepPlan")

    monkeypatch.setattr(paged_module, "plan_step", no_plan)
    import kvfold_runtime.kernels.dispatch as dispatch_module

    monkeypatch.setattr(dispatch_module, "plan_step", no_plan)
    out = torch.full_like(planned, float("nan"))
    got = paged(q, kv, table, lens, start, d_k, d_v, group, scaling=0.3, codec=codec, max_query_len=1, out=out)
    assert got is out and got.dtype == dtype and not got.isnan().any()
    assert torch.equal(got, planned)


@pytest.mark.parametrize("fmt", ["bits", "rank"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reader", ["c", "c-scalar"])
def test_a_decode_layer_in_one_c_call_writes_and_attends_as_the_separate_calls(fmt, dtype, reader, monkeypatch):
    """The vLLM backend's decode step of a layer in one C call (decode_layer_c) leaves the cache byte for byte as
    write_paged does and gives decode_step_c's output bit for bit, in each model dtype (a rank layer's cache in
    it too): requests of one to many blocks, keys and values with a row stride wider than their numbers (vLLM's
    fused q|k|v columns). Tensors not as it takes them are left to the general path (False, nothing written);
    caches it does not read (fp8 codes) get no decode layer."""
    monkeypatch.setenv("KVFOLD_CPU_DECODER", reader)
    _require_c_decoder()
    d_k, d_v, group, bs = [5, 12, 7], [3, 8, 17], 3, 16
    seq_lens = [1, 16, 17, 45, 130]
    dims = _banded(d_k, d_v, group) if fmt == "bits" else LayerDims(tuple(d_k), tuple(d_v), group)
    codec, g = row_codec(dims), torch.Generator().manual_seed(4)
    kv, table, lens, _, q, _, _ = _case(d_k, d_v, group, seq_lens, [1] * 5, block_size=bs, dtype=dtype)
    if fmt == "bits":  # the same tokens' rows as band codes
        kv = torch.zeros(*kv.shape[:-1], sum(dims.row_bytes()), dtype=torch.uint8)
        for r, s in enumerate(seq_lens):
            pos = torch.arange(s)
            write_paged(kv, table[r, pos // bs].long() * bs + pos % bs, torch.randn(s, sum(d_k), generator=g),
                        torch.randn(s, sum(d_v), generator=g), codec=codec)
    lens = lens.to(torch.int32)
    last = lens.long() - 1
    slots = table[torch.arange(len(seq_lens)), last // bs].long() * bs + last % bs
    fused = torch.randn(len(seq_lens), sum(d_k) + sum(d_v) + 3, generator=g).to(dtype)
    k, v = fused[:, :sum(d_k)], fused[:, sum(d_k):-3]
    kv_two, out_two = kv.clone(), torch.empty(len(seq_lens), group * sum(d_v), dtype=dtype)
    write_paged(kv_two, slots, k, v, codec=codec)
    paged_module.decode_step_c(q, kv_two, table, lens, codec, scaling=0.3, out=out_two)
    step = paged_module.decode_layer_c(dims, kv, None)
    out, before = torch.full_like(out_two, float("nan")), kv.clone()
    assert not step(q.double(), k, v, slots, kv, table, lens, out, 0.3) and out.isnan().all()  # not a step dtype
    assert torch.equal(kv.view(torch.uint8), before.view(torch.uint8))  # nothing written either
    assert step(q, k, v, slots, kv, table, lens, out, 0.3)
    assert torch.equal(kv.view(torch.uint8), kv_two.view(torch.uint8)) and torch.equal(out, out_two)  # NaN rows: bytes
    if fmt != "bits":  # a step in another dtype than the cache's: the general path; fp8 codes: no decode layer
        other = torch.float32 if dtype != torch.float32 else torch.bfloat16
        assert not step(q.to(other), k.to(other), v.to(other), slots, kv, table, lens, out.to(other), 0.3)
        assert paged_module.decode_layer_c(dims, torch.zeros(kv.shape, dtype=torch.uint8), torch.float8_e4m3fn) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rank_rows_written_in_c_equal_torchs_and_skip_padding(dtype, monkeypatch):
    """A rank layer's rows written in place in C (where it builds) hold what torch's scatter writes: the numbers
    converted to the cache's dtype, keys then values; padding slots and the other rows untouched."""
    _require_c_decoder()
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(4, 9, generator=g), torch.randn(4, 13, generator=g)
    slots = torch.tensor([6, -1, 0, 3])
    codec = row_codec(LayerDims((5, 4), (6, 7), 2))
    kv_c = torch.full((2, 1, 4, 22), 7.0, dtype=dtype)
    write_paged(kv_c, slots, k, v.t().contiguous().t(), codec=codec)  # values column-major: any strides
    monkeypatch.setattr(paged_module, "library", lambda: None)
    kv_t = torch.full_like(kv_c, 7.0)
    write_paged(kv_t, slots, k, v, codec=codec)
    assert torch.equal(kv_c, kv_t)
    assert torch.equal(kv_c.view(-1, 22)[6], torch.cat([k[0], v[0]]).to(dtype))
    assert (kv_c.view(-1, 22)[[1, 2, 4, 5, 7]] == 7.0).all()


@pytest.mark.parametrize("fmt", ["rank", "bits"])
def test_a_block_outer_cache_view_is_written_where_a_contiguous_one_is(fmt):
    """vLLM's block-outer layouts (a windowed export's, vllm/ring.py) give each layer a strided view: block b of
    layer 1 sits inside the b-th slab of every layer's pages. write_paged puts each row at the same slot as in a
    contiguous cache, and leaves the other layer's bytes alone."""
    dims = _banded([6, 3], [5, 8], 2) if fmt == "bits" else LayerDims((6, 3), (5, 8), 2)
    codec = row_codec(dims)
    c = sum(dims.row_bytes()) if fmt == "bits" else 22
    dtype = torch.uint8 if fmt == "bits" else torch.float32
    slab = torch.zeros(5, 2, 1, 4, c, dtype=dtype)  # [blocks, layers, 1 head, block_size, C]
    strided, flat = slab[:, 1], torch.zeros(5, 1, 4, c, dtype=dtype)
    k, v = torch.randn(7, 9), torch.randn(7, 13)
    slots = torch.tensor([5, 6, -1, 13, 0, 19, 2])
    assert not strided.is_contiguous()
    write_paged(strided, slots, k, v, codec=codec)
    write_paged(flat, slots, k, v, codec=codec)
    assert torch.equal(strided, flat) and not slab[:, 0].any()
