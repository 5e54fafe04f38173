"""The Triton bits kernels (kernels/triton_bits.py) against decode_heads + the reference and the paged torch path:
uneven widths (d_k ≠ d_v, a 1-wide head), GQA groups 3 and 8, bands of 16/8/6/5/4/3/2 bits with both scale formats
(log8, float16), odd row byte counts, contiguous caches (also as transformers' [B, 1, S, ·] layer) and paged ones
(shuffled blocks, 0xFF bytes in every unused row), decode with split contexts, prefill, chunked prefill against a
cached prefix, mixed batches, sliding windows, masks, float32, bfloat16 and float16 queries. The tables (bits_table)
are checked in plain torch too. On CUDA when there is one, else in Triton's interpreter (see test_triton.py)."""

import os

import pytest
import torch

import kvfold_runtime
from kvfold_runtime import LayerDims, bands_from_bits, paged_attention, reference_attention, write_paged
from kvfold_runtime.bands import decode_heads, encode_heads
from kvfold_runtime.kernels import bits_table, triton_bits
from tests.conftest import rerun_in_triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter must be switched on before triton is first imported: see test_triton.py
NEEDS_CHILD = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"
kernels = pytest.mark.skipif(NEEDS_CHILD, reason="no GPU: run in Triton's interpreter by test_in_the_interpreter")
# relative error of rounding float32 to each dtype: to nearest on the GPU (the interpreter truncates to bfloat16)
ROUNDING = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8 if DEVICE == "cuda" else 2.0 ** -7}
SCALE = 0.3
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.skipif(not NEEDS_CHILD, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    rerun_in_triton_interpreter(__file__, "-k", "not test_in_the_interpreter")


def _bits(*runs: tuple[int, int]) -> list[int]:
    """(bits, dims) runs -> per-dim widths."""
    return [b for b, n in runs for _ in range(n)]


def _layer(group, k_bits, k_scale, v_bits, v_scale) -> LayerDims:
    return LayerDims(tuple(map(len, k_bits)), tuple(map(len, v_bits)), group,
                     tuple(bands_from_bits(b, k_scale) for b in k_bits),
                     tuple(bands_from_bits(b, v_scale) for b in v_bits))


LAYERS = {
    # d_k 13/3/7 ≠ d_v 2/37/9; every band width somewhere, keys' scales log8, values' float16
    "uneven": _layer(3, [_bits((16, 2), (8, 3), (5, 2), (4, 3), (3, 2), (2, 1)), _bits((2, 3)), _bits((16, 5), (4, 2))],
                     "log8", [_bits((8, 2)), _bits((16, 4), (6, 3), (3, 30)), _bits((5, 9))], "float16"),
    # one KV head, GQA group 8, d_k 37 vs d_v 1; keys' scales float16, values' log8
    "one head": _layer(8, [_bits((16, 1), (8, 4), (5, 7), (4, 9), (3, 5), (2, 11))], "float16", [_bits((3, 1))],
                       "log8"),
}


def test_the_layers_rows_have_odd_byte_counts():
    """Odd rows: no code, scale or value is aligned beyond a byte in a paged row ([keys | values])."""
    assert LAYERS["uneven"].row_bytes() == (32, 39) and LAYERS["one head"].row_bytes() == (31, 2)


def _kv(dims: LayerDims, *lead: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [*lead, Σd] as kvfold's rotations leave them (magnitudes falling along each head's dims)
    at per-token magnitudes spanning 2^±2, so the bands' scales take many values."""
    def side(widths):
        x = torch.randn(*lead, sum(widths), generator=g)
        fall = torch.cat([torch.logspace(0.5, -0.5, w) for w in widths])
        return x * fall * torch.exp2(torch.empty(*lead, 1).uniform_(-2, 2, generator=g))

    return side(dims.d_k), side(dims.d_v)


def _read(rows: torch.Tensor, widths, bands, dtype) -> torch.Tensor:
    """What the kernels read from cached rows, as float32: decode_heads' values rounded to the query dtype, as
    the GPU rounds them (to nearest); the interpreter truncates float32 to bfloat16, so here that is mimicked."""
    x = decode_heads(rows, widths, bands, torch.float32)
    if dtype == BF16 and DEVICE == "cpu":
        return (x.view(torch.int32) & -65536).view(torch.float32)
    return x.to(dtype).float()


def _check(got, q, k_rows, v_rows, dims: LayerDims, mask=None):
    """float32: within 1e-5 · (1 + Σ p|v|) of the reference on decode_heads' keys and values (float32 sums in
    another order, on values up to tens). bfloat16, float16: within 2e-3 of
    the float32 reference on the keys and values as read in that dtype, plus the two roundings the contract makes
    (the softmax weights to the value dtype, the output), each within ROUNDING of what it rounds. A query row
    whose mask allows no key must give exactly 0 (as torch's SDPA) and is left out of the comparison."""
    d_k, d_v, group = list(dims.d_k), list(dims.d_v), dims.group
    k, v = _read(k_rows, d_k, dims.k_bands, q.dtype), _read(v_rows, d_v, dims.v_bands, q.dtype)
    want = reference_attention(q.float(), k, v, d_k, d_v, group, scaling=SCALE, mask=mask)
    err = (got.float() - want).abs()
    if mask is not None:
        b, t, s = q.shape[0], q.shape[1], k.shape[1]
        heads = group * len(d_k)
        some = mask[..., :s].any(-1).expand(b, heads, t)  # [B, H, T]: the query head sees at least one key
        cols = torch.cat([some[:, h, :, None].expand(b, t, d_v[h // group]) for h in range(heads)], -1)
        assert torch.equal(got[~cols].float(), torch.zeros_like(got[~cols].float()))
        err = torch.where(cols, err, 0.0)
    weighted = reference_attention(q.float(), k, v.abs(), d_k, d_v, group, scaling=SCALE, mask=mask)  # Σ p|v|
    if got.dtype == F32:
        excess = err - 1e-5 * (1 + weighted)
    else:
        excess = err - (2e-3 + ROUNDING[got.dtype] * (want.abs() + weighted))
    assert excess.max() <= 0, float(err.max())


def _causal(t: int, s: int, window: int | None = None) -> torch.Tensor:
    """[1, 1, t, s]: the t queries are the last of the s positions."""
    q, k = torch.arange(s - t, s)[:, None], torch.arange(s)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed[None, None].to(DEVICE)


def test_the_tables_locate_every_code_and_scale():
    """Gathering through the tables in plain torch, as the kernels do, reads back decode_heads' values (to the
    last bits of exp2, which torch's CPU code itself computes differently on tensors of different sizes)."""
    g = torch.Generator().manual_seed(0)
    for dims in LAYERS.values():
        for x, widths, bands in zip(_kv(dims, 50, g=g), (dims.d_k, dims.d_v), (dims.k_bands, dims.v_bands),
                                    strict=True):
            rows = encode_heads(x, widths, bands)
            rows = torch.cat([rows, torch.full((50, 1), 255, dtype=torch.uint8)], -1)  # a byte past every row
            fields = bits_table.unpack(bits_table.band_table(widths, bands, "cpu"))  # each [G, W]
            at, shift, bits, s_at, kind = (fields[f].long().expand(50, -1, -1)  # [N, G, W]
                                           for f in ("byte", "shift", "bits", "scale_at", "kind"))
            r = rows.long()[:, None, :].expand(-1, len(widths), -1)  # [N, G, bytes]
            word = r.gather(-1, at) | r.gather(-1, at + 1) << 8
            code = (word >> shift) & ((1 << bits) - 1)
            level = code + 0.5 - (1 << (bits - 1).clamp(min=0))
            s_word = r.gather(-1, s_at) | r.gather(-1, s_at + 1) << 8
            s = torch.where(kind == 2, s_word.to(torch.int16).view(torch.float16).float(),
                            torch.exp2(((s_word & 255) - 128) / 8))
            got = torch.where(bits == 16, word.to(torch.int16).view(torch.float16).float(), level * s)
            got = torch.where(bits > 0, got, 0.0)
            want = decode_heads(rows[:, :-1], widths, bands, torch.float32)
            for h, w in enumerate(widths):
                torch.testing.assert_close(got[:, h, :w], want[:, sum(widths[:h]):sum(widths[:h + 1])],
                                           rtol=1e-6, atol=0)
                assert (bits[0, h, w:] == 0).all()


def _rows(dims: LayerDims, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached rows (uint8) of keys and values, on the test device."""
    return (encode_heads(k, dims.d_k, dims.k_bands).to(DEVICE), encode_heads(v, dims.d_v, dims.v_bands).to(DEVICE))


def _query(dims: LayerDims, *lead: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*lead, dims.q_width, generator=g).to(dtype).to(DEVICE)


@kernels
@pytest.mark.parametrize(("layer", "t", "window", "splits", "dtype"), [
    ("uneven", 1, None, 1, F32), ("uneven", 1, 20, 3, BF16), ("one head", 1, None, 2, F16),
    ("uneven", 20, None, None, F32), ("uneven", 20, 9, None, F16), ("one head", 5, None, 2, BF16),
    ("one head", 70, 30, None, F32)])
def test_contiguous_matches_reference(layer, t, window, splits, dtype):
    """Decode (split contexts), prefill (one with split contexts too) and a prefill of the whole sequence;
    t = 20 reads the rows as a transformers cache layer holds them ([B, 1, S, bytes])."""
    dims = LAYERS[layer]
    g = torch.Generator().manual_seed(t)
    b, s = 2, 70
    k_rows, v_rows = _rows(dims, *_kv(dims, b, s, g=g))
    q = _query(dims, b, t, g=g, dtype=dtype)
    cache = (k_rows[:, None], v_rows[:, None]) if t == 20 else (k_rows, v_rows)
    got = kvfold_runtime.bits_attention(q, *cache, dims, scaling=SCALE, sliding_window=window,
                                        num_splits=splits)
    assert got.shape == (b, t, dims.out_width) and got.dtype == dtype
    _check(got, q, k_rows, v_rows, dims, _causal(t, s, window))


@kernels
@pytest.mark.parametrize("t", [1, 6])
def test_contiguous_per_sequence_lengths_never_read_past_the_end(t):
    dims = LAYERS["uneven"]
    g = torch.Generator().manual_seed(1)
    lens = [70, 7, 33]
    k_rows, v_rows = _rows(dims, *_kv(dims, 3, 70, g=g))
    k_rows[1, 7:], v_rows[2, 33:] = 255, 255  # 0xFF bytes: NaN where a 16-bit band reads them
    q = _query(dims, 3, t, g=g, dtype=F32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = triton_bits.bits_attention(q, k_rows, v_rows, dims, scaling=SCALE, seq_lens=seq_lens, sliding_window=40,
                                     num_splits=2 if t == 1 else None)
    for i, n in enumerate(lens):
        _check(got[i:i + 1], q[i:i + 1], k_rows[i:i + 1, :n], v_rows[i:i + 1, :n], dims, _causal(t, n, window=40))


@kernels
@pytest.mark.parametrize(("t", "dtype"), [(1, F32), (12, F32), (12, BF16)])
def test_contiguous_with_a_mask(t, dtype):
    """A left-padded batch as transformers passes it: the mask alone decides; query rows in the padding give 0.
    The same mask as additive float32 (0 / -inf) gives the same result."""
    dims = LAYERS["uneven"]
    g = torch.Generator().manual_seed(2)
    b, s = 2, 40
    k_rows, v_rows = _rows(dims, *_kv(dims, b, s, g=g))
    q = _query(dims, b, t, g=g, dtype=dtype)
    mask = _causal(t, s).expand(b, 1, t, s).clone()
    mask[-1, ..., :s - t + 5] = False  # the last sequence: 5 queries in its padding (t = 12), none for t = 1
    mask = torch.cat([mask, torch.ones(b, 1, t, 3, dtype=torch.bool, device=DEVICE)], -1)  # spare keys: unread
    got = triton_bits.bits_attention(q, k_rows, v_rows, dims, scaling=SCALE, mask=mask,
                                     num_splits=2 if t == 1 else None)
    _check(got, q, k_rows, v_rows, dims, mask[..., :s])
    if dtype == F32:
        additive = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, float("-inf"))
        again = triton_bits.bits_attention(q, k_rows, v_rows, dims, scaling=SCALE, mask=additive)
        assert (again - got).abs().max() <= 1e-6


def _paged(dims: LayerDims, seq_lens, q_lens, dtype, block_size=16, seed=0):
    """A paged bits cache [num_blocks, 1, block_size, K_bytes + V_bytes] uint8 holding `seq_lens` tokens per
    request in shuffled blocks (written by write_paged, as vLLM's backend would), 0xFF bytes everywhere else, and
    each request's last `q_lens` tokens as queries. Returns the paged inputs and per request its rows and
    queries."""
    g = torch.Generator().manual_seed(seed)
    per = [(s + block_size - 1) // block_size for s in seq_lens]
    order = torch.randperm(sum(per) + 3, generator=g)[: sum(per)] + 1  # block 0 and a few others stay unused
    kv = torch.full((int(order.max()) + 2, 1, block_size, sum(dims.row_bytes())), 255, dtype=torch.uint8,
                    device=DEVICE)
    table = torch.zeros(len(seq_lens), max(per) + 1, dtype=torch.int32)  # a spare column, as vLLM's
    seqs, used = [], 0
    for r, s in enumerate(seq_lens):
        table[r, :per[r]] = order[used:used + per[r]]
        used += per[r]
        k_rows, v_rows = _rows(dims, *_kv(dims, s, g=g))
        pos = torch.arange(s)
        write_paged(kv, (table[r, pos // block_size].long() * block_size + pos % block_size).to(DEVICE), k_rows,
                    v_rows)
        seqs.append((k_rows, v_rows, _query(dims, q_lens[r], g=g, dtype=dtype)))
    start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return kv, table.to(DEVICE), lens, start, torch.cat([s[2] for s in seqs]), seqs


def _torch_paged(q, kv, table, lens, start, dims: LayerDims, window):
    """The torch paged path over the cache dequantized (float32): what the kernels must give without the copy."""
    k_bytes = dims.row_bytes()[0]
    dense = torch.cat([decode_heads(kv[..., :k_bytes], dims.d_k, dims.k_bands, F32),
                       decode_heads(kv[..., k_bytes:], dims.d_v, dims.v_bands, F32)], -1)
    return paged_attention(q, dense, table, lens, start, list(dims.d_k), list(dims.d_v), dims.group, scaling=SCALE,
                           sliding_window=window)


@kernels
@pytest.mark.parametrize(("layer", "seq_lens", "q_lens", "window", "splits", "dtype"), [
    ("uneven", [100, 1, 37, 64], [1] * 4, None, None, F32),  # decode: the default splits
    ("uneven", [100, 1, 37, 64], [1] * 4, 20, 3, BF16),
    ("one head", [100, 1, 37, 64], [1] * 4, None, 2, F16),
    ("uneven", [40, 30, 45], [1, 30, 20], 10, None, F32),  # a decode, a prefill, a chunked prefill
    ("uneven", [40, 30, 45], [1, 30, 20], None, None, F16),
    ("one head", [40, 30, 45], [1, 30, 20], 30, None, BF16)])
def test_paged_matches_the_torch_path_and_reference(layer, seq_lens, q_lens, window, splits, dtype):
    dims = LAYERS[layer]
    kv, table, lens, start, q, seqs = _paged(dims, seq_lens, q_lens, dtype, seed=len(q_lens))
    out = torch.full((q.shape[0], dims.out_width), float("nan"), dtype=dtype, device=DEVICE)
    got = kvfold_runtime.paged_bits_attention(q, kv, table, lens, start, dims, scaling=SCALE, sliding_window=window,
                                              out=out, num_splits=splits,
                                              max_query_len=max(q_lens) if dtype != F32 else None)
    assert got is out and not got.isnan().any()
    if dtype == F32:
        torch.testing.assert_close(got, _torch_paged(q, kv, table, lens, start, dims, window), rtol=1e-5, atol=1e-5)
    for r, (k_rows, v_rows, qr) in enumerate(seqs):
        _check(got[start[r]:start[r + 1]][None], qr[None], k_rows[None], v_rows[None], dims,
               _causal(q_lens[r], seq_lens[r], window=window))


def test_wrong_inputs_are_refused_with_the_fix():
    dims = LAYERS["one head"]
    k_bytes, v_bytes = dims.row_bytes()
    q = torch.zeros(1, 1, dims.q_width)
    k_rows, v_rows = torch.zeros(1, 4, k_bytes, dtype=torch.uint8), torch.zeros(1, 4, v_bytes, dtype=torch.uint8)
    rank = LayerDims(dims.d_k, dims.d_v, dims.group)
    with pytest.raises(ValueError, match="decode_attention"):
        triton_bits.bits_attention(q, k_rows, v_rows, rank, scaling=1.0)
    with pytest.raises(ValueError, match="group"):
        triton_bits.bits_attention(q[..., 1:], k_rows, v_rows, dims, scaling=1.0)
    with pytest.raises(ValueError, match="row_bytes"):
        triton_bits.bits_attention(q, k_rows[..., 1:], v_rows, dims, scaling=1.0)
    with pytest.raises(ValueError, match="row_bytes"):
        triton_bits.bits_attention(q, k_rows.float(), v_rows, dims, scaling=1.0)
    with pytest.raises(ValueError, match=r"\[B, 1, S, bytes\]"):
        triton_bits.bits_attention(q, k_rows[:, None].expand(-1, 2, -1, -1), v_rows, dims, scaling=1.0)
    with pytest.raises(ValueError, match="not both"):
        triton_bits.bits_attention(q, k_rows, v_rows, dims, scaling=1.0, sliding_window=2,
                                   mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="last tokens"):
        triton_bits.bits_attention(q.expand(1, 5, -1), k_rows, v_rows, dims, scaling=1.0)
    kv = torch.zeros(3, 16, k_bytes + v_bytes + 1, dtype=torch.uint8)
    starts, lens, table = torch.tensor([0, 1]), torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="row_bytes"):
        triton_bits.paged_bits_attention(q[0], kv, table, lens, starts, dims, scaling=1.0)
    with pytest.raises(ValueError, match="`out`"):
        triton_bits.paged_bits_attention(q[0], kv[..., 1:], table, lens, starts, dims, scaling=1.0,
                                         out=torch.zeros(1, dims.out_width + 1))


@kernels
def test_the_paged_dispatch_takes_the_bits_kernel_where_triton_runs(monkeypatch):
    """What vLLM's KVFOLD backend calls (kernels.dispatch.paged with the layer's BandRows codec): on CUDA (here:
    KVFOLD_KERNELS=triton in the interpreter) the bits kernel runs, and gives the torch path's result."""
    from kvfold_runtime import BandRows
    from kvfold_runtime.kernels import dispatch

    dims = LAYERS["uneven"]
    kv, table, lens, start, q, _ = _paged(dims, [40, 30, 45], [1, 30, 20], F32, seed=4)
    calls = []
    real = triton_bits.paged_bits_attention
    monkeypatch.setattr(triton_bits, "paged_bits_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("KVFOLD_KERNELS", "triton")
    codec = BandRows(dims)
    assert dispatch.paged_kernels_for(q, codec) == "triton"
    got = dispatch.paged(q, kv, table, lens, start, list(dims.d_k), list(dims.d_v), dims.group, scaling=SCALE,
                         codec=codec, max_query_len=30)
    assert calls == [1]
    torch.testing.assert_close(got, _torch_paged(q, kv, table, lens, start, dims, None), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("KVFOLD_KERNELS", "torch")
    assert dispatch.paged_kernels_for(q, codec) == "torch"
