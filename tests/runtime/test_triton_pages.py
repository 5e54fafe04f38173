"""The GPU page layout (kvfold_runtime.pages) and its Triton kernel (kernels/triton_pages.py): a page is its tokens'
rows with the bits moved (both ways, and written slot by slot as vLLM writes), every plane field where the layout
says; the kernel equals the reference on decode_heads' keys and values — every width (16/8/6/5/4/3/2 bits), uneven
widths (d_k ≠ d_v, heads of different kinds), GQA groups 3 and 8, pages of 16 and 32 tokens in shuffled blocks with
0xFF bytes in every unwritten row, decode with split contexts, prefill and chunked prefill mixed in one batch,
sliding windows, float32, bfloat16 and float16 queries. On CUDA when there is one, else in Triton's interpreter."""

import os

import pytest
import torch

from kvfold_runtime import LayerDims, reference_attention
from kvfold_runtime.bands import decode_heads, encode_heads
from kvfold_runtime.pages import PLANES, PageLayout, aligned, chunk_of, page_layout
from tests.conftest import rerun_in_triton_interpreter
from tests.runtime.test_triton_bits import _bits, _layer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEEDS_CHILD = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"
kernels = pytest.mark.skipif(NEEDS_CHILD, reason="no GPU: run in Triton's interpreter by test_in_the_interpreter")
SCALE = 0.3
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.skipif(not NEEDS_CHILD, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    rerun_in_triton_interpreter(__file__, "-k", "not test_in_the_interpreter")


def _aligned(group, k_bits, v_bits) -> LayerDims:
    """A layer whose bands are all log8-scaled (the page layout's), from per-head widths (test_triton_bits._bits)."""
    return _layer(group, k_bits, "log8", v_bits, "log8")


LAYERS = {
    # three KV heads of three kinds, d_k 80/128/32 ≠ d_v 32/48/96, every width somewhere
    "mixed": _aligned(3, [_bits((16, 16), (8, 16), (5, 16), (3, 32)), _bits((6, 32), (4, 64), (2, 32)),
                          _bits((4, 32))],
                      [_bits((4, 16), (2, 16)), _bits((5, 16), (3, 32)), _bits((8, 16), (6, 16), (4, 32), (2, 32))]),
    # one KV head, GQA group 8
    "one head": _aligned(8, [_bits((8, 32), (4, 32))], [_bits((3, 16))]),
    # bands on 8-dim chunks (a head_dim-64 allocation), every width at 8 dims: 1- and 2-bit planes shared by tokens
    "eighths": _aligned(2, [_bits((16, 8), (8, 8), (6, 8), (5, 8), (4, 16), (3, 8), (2, 8)), _bits((5, 24), (3, 8))],
                        [_bits((4, 8), (2, 8)), _bits((6, 16), (3, 24), (2, 8))]),
    # the same over a 128-dim tile: tiles made in the MMA's registers (triton_tiles), on 8-dim chunks
    "wide eighths": _aligned(2, [_bits((16, 8), (8, 8), (6, 8), (5, 8), (4, 16), (3, 8), (2, 72)),
                                 _bits((5, 24), (3, 8))],
                             [_bits((4, 8), (2, 8)), _bits((6, 16), (3, 24), (2, 8))]),
}


def _kv(dims: LayerDims, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [n, Σd] with magnitudes falling along each head's dims, per-token magnitudes spanning 2^±2."""
    def side(widths):
        x = torch.randn(n, sum(widths), generator=g)
        fall = torch.cat([torch.logspace(0.5, -0.5, w) for w in widths])
        return x * fall * torch.exp2(torch.empty(n, 1).uniform_(-2, 2, generator=g))

    return side(dims.d_k), side(dims.d_v)


def _rows(dims: LayerDims, k, v) -> torch.Tensor:
    return torch.cat([encode_heads(k, dims.d_k, dims.k_bands), encode_heads(v, dims.d_v, dims.v_bands)], -1)


def test_aligned_layers_only():
    assert all(aligned(d) for d in LAYERS.values())
    assert [chunk_of(d) for d in LAYERS.values()] == [16, 16, 8, 8]
    odd = _aligned(1, [_bits((4, 12), (2, 4))], [_bits((4, 16))])  # bands of 12 and 4 dims
    assert not aligned(odd)
    with pytest.raises(ValueError, match="aligned allocation"):
        PageLayout(odd, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        PageLayout(LAYERS["mixed"], 24)


@pytest.mark.parametrize(("layer", "page"), [("mixed", 16), ("mixed", 32), ("eighths", 16), ("eighths", 32)])
def test_a_page_is_its_rows_rearranged(layer, page):
    """to_page / to_rows invert each other; writing rows slot by slot in any order gives the same pages."""
    dims = LAYERS[layer]
    layout = page_layout(dims, page)
    g = torch.Generator().manual_seed(page)
    rows = _rows(dims, *_kv(dims, 2 * page, g))
    pages = layout.to_page(rows.view(2, page, -1))
    assert pages.shape == (2, page * sum(dims.row_bytes()))
    assert torch.equal(layout.to_rows(pages).reshape(2 * page, -1), rows)
    cache = torch.full((4, page * layout.row_bytes), 255, dtype=torch.uint8)
    slots = torch.cat([torch.arange(page) + 3 * page, torch.arange(page) + page])  # blocks 3 and 1
    order = torch.randperm(2 * page, generator=g)
    layout.write(cache, slots[order], rows[order])
    assert torch.equal(cache[3], pages[0]) and torch.equal(cache[1], pages[1])
    assert (cache[[0, 2]] == 255).all()


@pytest.mark.parametrize(("layer", "page"), [("mixed", 16), ("eighths", 32)])
def test_a_kinds_offsets_are_the_tables(layer, page):
    """The kernels address a head's planes and scales at its kind's compile-time offsets from its first plane: they
    are the table's offsets, head by head."""
    layout = page_layout(LAYERS[layer], page)
    kinds, of_head = layout.kinds()
    table = layout.table("cpu")
    for side in range(2):
        for h, k in enumerate(of_head):
            widths, planes, scales = kinds[k][3 * side:3 * side + 3]
            first = int(table[side, h, 1, 0])
            for c, width in enumerate(widths):
                if width == 0:
                    continue
                assert int(table[side, h, 0, c]) == width
                assert int(table[side, h, 1, c]) == first + page * planes[c]
                if width != 16:
                    assert first + page * scales[c] in table[side, h, 2].tolist()
    assert len(kinds) == len(set(of_head)) and len(kinds) > 1


@pytest.mark.parametrize("layer", ["mixed", "eighths"])
def test_every_field_is_where_the_layout_says(layer):
    """Read each chunk's codes back from a page as the kernel does (pairs of dims in the lanes of 32-bit words;
    a word shared by two or four tokens where a token's entry is smaller) and compare with the row's codes."""
    dims, page = LAYERS[layer], 16
    layout = page_layout(dims, page)
    n = layout.chunk
    g = torch.Generator().manual_seed(0)
    rows = _rows(dims, *_kv(dims, page, g))
    flat = layout.to_page(rows[None])[0]
    table = layout.table("cpu")
    tok = torch.arange(page)
    for side, (widths, bands) in enumerate(((dims.d_k, dims.k_bands), (dims.d_v, dims.v_bands))):
        row_at = side * dims.row_bytes()[0]
        for h, head in enumerate(bands):
            codes = _row_codes(rows[:, row_at:], head)  # [P, d] int
            for c in range(widths[h] // n):
                width, region = int(table[side, h, 0, c]), int(table[side, h, 1, c])
                got = torch.zeros(page, n, dtype=torch.long)
                low = 0
                for p in PLANES[width]:
                    got |= _plane_fields(flat, region, p, tok, n) << low
                    region += page * n * p // 8
                    low += p
                if width == 16:
                    got = got & 0xFFFF
                assert torch.equal(got, codes[:, n * c:n * c + n]), (side, h, c, width)
            row_at += sum(b.code_bytes + b.scale_bytes for b in head)


def _row_codes(rows: torch.Tensor, head) -> torch.Tensor:
    """A head's codes (16-bit bands: the float16 bits) from its row, [P, d]."""
    out, at = [], 0
    for band in head:
        bits = ((rows[:, at:at + band.code_bytes, None].long() >> torch.arange(8)) & 1).flatten(1)
        out.append((bits[:, :band.size * band.bits].unflatten(1, (band.size, band.bits))
                    << torch.arange(band.bits)).sum(-1))
        at += band.code_bytes
    return torch.cat(out, -1)


def _plane_fields(flat: torch.Tensor, region: int, p: int, tok: torch.Tensor, n: int) -> torch.Tensor:
    """[P, n] the p-bit fields of a plane of n-dim chunks: dim 2k + h is lane h of a 32-bit word; a token's lane holds
    L = n/2·p bits, and where L < 16, 16/L tokens share a word (module docs of pages)."""
    words = flat[region:region + len(tok) * n * p // 8].view(torch.int32).long() & 0xFFFFFFFF
    lane = n // 2 * p
    out = torch.zeros(len(tok), n, dtype=torch.long)
    for k in range(n // 2):
        for h in range(2):
            if lane == 4:  # four tokens a word: token t's byte t, lane 0 in its low nibble
                at = 8 * (tok % 4) + 4 * h + k * p
            elif lane == 8:  # two tokens a word: token t's lane-h byte at byte 2h + t mod 2
                at = 16 * h + 8 * (tok % 2) + k * p
            else:
                per_lane = 16 // p
                at = 16 * h + p * (k % per_lane) + 32 * (k // per_lane)
            word = words[tok * lane // 16 + at // 32] if lane >= 16 else words[tok // (16 // lane)]
            out[:, 2 * k + h] = (word >> (at % 32)) & ((1 << p) - 1)
    return out


def _paged(dims: LayerDims, seq_lens, q_lens, dtype, page, seed):
    """A paged cache of `page`-token pages holding each request's tokens in shuffled blocks (written slot by slot),
    0xFF everywhere else; per request its rows and queries."""
    g = torch.Generator().manual_seed(seed)
    layout = page_layout(dims, page)
    per = [(s + page - 1) // page for s in seq_lens]
    order = torch.randperm(sum(per) + 3, generator=g)[: sum(per)] + 1
    kv = torch.full((int(order.max()) + 2, 1, page, layout.row_bytes), 255, dtype=torch.uint8)
    table = torch.zeros(len(seq_lens), max(per) + 1, dtype=torch.int32)
    seqs, used = [], 0
    for r, s in enumerate(seq_lens):
        table[r, :per[r]] = order[used:used + per[r]]
        used += per[r]
        rows = _rows(dims, *_kv(dims, s, g))
        pos = torch.arange(s)
        layout.write(kv, table[r, pos // page].long() * page + pos % page, rows)
        seqs.append((rows, torch.randn(q_lens[r], dims.q_width, generator=g).to(dtype)))
    start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (kv.to(DEVICE), table.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            start.to(DEVICE), torch.cat([s[1] for s in seqs]).to(DEVICE), seqs)


def _reference(rows, q, dims: LayerDims, window):
    """float32 attention of q (the last tokens) over decode_heads' keys and values of `rows` as the kernel reads them
    in the query's dtype: the scale rounded to it, then the value (in Triton's interpreter the kernel makes bfloat16
    values in float32)."""
    k_bytes = dims.row_bytes()[0]
    read = q.dtype if q.dtype == F16 or DEVICE == "cuda" else F32
    k = decode_heads(rows[:, :k_bytes], dims.d_k, dims.k_bands, read, scale_dtype=read).float()
    v = decode_heads(rows[:, k_bytes:], dims.d_v, dims.v_bands, read, scale_dtype=read).float()
    t, s = q.shape[0], k.shape[0]
    allowed = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
    if window is not None:
        allowed &= torch.arange(s - t, s)[:, None] - torch.arange(s)[None, :] < window
    want = reference_attention(q.float()[None], k[None], v[None], list(dims.d_k), list(dims.d_v), dims.group,
                               scaling=SCALE, mask=allowed[None, None])[0]
    weighted = reference_attention(q.float()[None], k[None], v.abs()[None], list(dims.d_k), list(dims.d_v),
                                   dims.group, scaling=SCALE, mask=allowed[None, None])[0]
    # how far a score can move when every key is one rounding off (Triton's interpreter rounds the kernel's
    # multiply-add twice, the GPU once): scaling · Σ_d |q_d k_d| · 2u, the largest over the keys, per query head,
    # spread over that head's output columns
    u = {F32: 2.0 ** -24, F16: 2.0 ** -11, BF16: 2.0 ** -8}[q.dtype]
    noise = []
    for h in range(dims.group * dims.num_kv_heads):
        g = h // dims.group
        qh = q.float()[:, dims.group * dims.k_offsets[g] + (h % dims.group) * dims.d_k[g]:][:, :dims.d_k[g]]
        kg = k[:, dims.k_offsets[g]:dims.k_offsets[g] + dims.d_k[g]]
        bound = SCALE * (qh.abs() @ kg.abs().T).amax(-1, keepdim=True) * 2 * u  # [t, 1]
        noise.append(bound.expand(-1, dims.d_v[g]))
    return want, weighted, torch.cat(noise, -1)


# (absolute, relative) error the output may carry besides the scores' noise: float32 sums in another order; in half
# precision 2e-3 (as test_triton_bits) plus a rounding each of the value, the weights and the output (the interpreter
# truncates float32 to bfloat16)
TOLERANCE = {F32: (1e-5, 1e-5), F16: (2e-3, 3 * 2.0 ** -11), BF16: (2e-3, 3 * 2.0 ** -7)}


@kernels
@pytest.mark.parametrize(("layer", "seq_lens", "q_lens", "window", "splits", "dtype", "page"), [
    ("mixed", [100, 1, 37, 64], [1] * 4, None, None, F32, 16),  # decode
    ("mixed", [100, 1, 37, 64], [1] * 4, 20, 3, BF16, 16),
    ("one head", [100, 1, 37, 64], [1] * 4, None, 2, F16, 32),
    ("mixed", [40, 30, 45], [1, 30, 20], 10, None, BF16, 32),  # a decode, a prefill, a chunked prefill
    ("mixed", [40, 30, 45], [1, 30, 20], None, None, F16, 16),
    ("one head", [40, 30, 45], [1, 30, 20], 30, None, F32, 16),
    ("eighths", [100, 1, 37, 64], [1] * 4, None, 3, BF16, 16),  # 8-dim chunks
    ("eighths", [40, 30, 45], [1, 30, 20], 10, None, F16, 32),
    ("eighths", [40, 30, 45], [1, 30, 20], None, None, F32, 16),
    ("wide eighths", [100, 1, 37, 64], [1] * 4, None, 3, BF16, 16),  # tiles in the MMA's registers, 8-dim chunks
    ("wide eighths", [40, 30, 45], [1, 30, 20], 10, None, F16, 32),
    ("wide eighths", [300, 45], [1, 20], None, 2, BF16, 128),
    # pages longer than a key block (BLOCK_N 64 here, 128 for "eighths"): a block is part of one page
    ("mixed", [300, 1, 137], [1] * 3, None, 2, BF16, 128),
    ("mixed", [140, 200], [1, 30], 50, None, F16, 128),
    ("eighths", [300, 45], [1, 20], 40, None, BF16, 256)])
def test_paged_matches_the_reference(layer, seq_lens, q_lens, window, splits, dtype, page):
    from kvfold_runtime.kernels.triton_pages import paged_pages_attention

    dims = LAYERS[layer]
    kv, table, lens, start, q, seqs = _paged(dims, seq_lens, q_lens, dtype, page, seed=len(q_lens))
    out = torch.full((q.shape[0], dims.out_width), float("nan"), dtype=dtype, device=DEVICE)
    got = paged_pages_attention(q, kv, table, lens, start, dims, scaling=SCALE, sliding_window=window, out=out,
                                num_splits=splits, max_query_len=max(q_lens))
    assert got is out and not got.isnan().any()
    for r, (rows, qr) in enumerate(seqs):
        want, weighted, noise = _reference(rows, qr, dims, window)
        err = (got[start[r]:start[r + 1]].float().cpu() - want).abs()
        atol, rtol = TOLERANCE[dtype]
        excess = err - (atol + rtol * want.abs() + (rtol + noise) * weighted)
        assert excess.max() <= 0, (r, float(err.max()))


@kernels
def test_vllms_path_writes_pages_and_reads_them_where_triton_runs(monkeypatch):
    """What vLLM's KVFOLD backend does with an aligned bits layer where the Triton kernels run (on CUDA, or
    KVFOLD_KERNELS=triton in the interpreter): row_codec gives the page codec for its block size, write_paged puts
    each token at its slot in page order (padding slots skipped), dispatch.paged runs the page kernel, or with the
    batch split (StepSplit, as the builder makes it on CUDA) the page kernel for the decode and the prefill's pages
    decoded once then SDPA; with the torch path forced, the same cache is read as rows. All give the reference."""
    from kvfold_runtime import row_codec, write_paged
    from kvfold_runtime.kernels import dispatch, triton_pages
    from kvfold_runtime.kernels.paged import BandPages, BandRows

    dims, page = LAYERS["mixed"], 16
    assert isinstance(row_codec(dims, page=page), BandPages)
    assert type(row_codec(dims, page=24)) is BandRows and type(row_codec(dims)) is BandRows
    g = torch.Generator().manual_seed(5)
    seq_lens, q_lens = [40, 30], [1, 30]
    codec = row_codec(dims, page=page)
    kv = torch.full((8, 1, page, codec.layout.row_bytes), 255, dtype=torch.uint8, device=DEVICE)
    table = torch.tensor([[3, 1, 6], [2, 5, 0]], dtype=torch.int32, device=DEVICE)
    seqs = []
    for r, s in enumerate(seq_lens):
        k, v = _kv(dims, s, g)
        pos = torch.arange(s)
        slots = torch.cat([table[r, pos // page].cpu().long() * page + pos % page, torch.tensor([-1, -1])])  # padded
        write_paged(kv, slots.to(DEVICE), torch.cat([k, k[:2]]).to(DEVICE), torch.cat([v, v[:2]]).to(DEVICE),
                    codec=codec)
        seqs.append((_rows(dims, k, v), torch.randn(q_lens[r], dims.q_width, generator=g)))
    q = torch.cat([s[1] for s in seqs]).to(DEVICE)
    start = torch.tensor([0, 1, 31], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    assert (kv[[0, 4, 7]] == 255).all()  # blocks no sequence holds
    calls = []
    real = triton_pages.paged_pages_attention
    monkeypatch.setattr(triton_pages, "paged_pages_attention",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    outs = []
    for mode in ("triton", "torch"):
        monkeypatch.setenv("KVFOLD_KERNELS", mode)
        outs.append(dispatch.paged(q, kv, table, lens, start, list(dims.d_k), list(dims.d_v), dims.group,
                                   scaling=SCALE, codec=codec, max_query_len=30))
    assert calls == [31]
    # split as vLLM's builder splits it on CUDA: the decode by the page kernel, the prefill's pages decoded once
    monkeypatch.setenv("KVFOLD_KERNELS", "triton")
    split = dispatch.StepSplit(1, 1, ((1, 1, 30, 30),))
    outs.append(dispatch.paged(q, kv, table, lens, start, list(dims.d_k), list(dims.d_v), dims.group, scaling=SCALE,
                               codec=codec, max_query_len=30, split=split))
    assert calls == [31, 1]
    for got in outs:
        for r, (rows, qr) in enumerate(seqs):
            want, weighted, noise = _reference(rows, qr, dims, None)
            err = (got[start[r]:start[r + 1]].cpu() - want).abs()
            atol, rtol = TOLERANCE[F32]
            assert (err - (atol + rtol * want.abs() + (rtol + noise) * weighted)).max() <= 0, float(err.max())
