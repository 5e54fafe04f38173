"""Attention in Triton over a bits-format cache in the GPU page layout (kvfold_runtime.pages): codes read as whole
32-bit words, two numbers unpacked by one 32-bit operation, made floats without an integer-to-float conversion, and
multiplied by tensor cores (issue 50: a handful of instructions per cached number, where triton_bits.py's row
kernel takes ~56).

The paged cache is one uint8 tensor [num_blocks, (1,) P, C] (vLLM's view of a layer) whose every block is a page of
pages.PageLayout. Requests are described as vLLM does (query_start_loc, seq_lens, block_table), and the contract is
triton_bits.paged_bits_attention's: keys and values read back as bands.decode_heads gives them, in the query's
dtype, then reference_attention (the model's scaling, float32 softmax and sums, query head h reads KV head
h // group), causal, optionally within a sliding window. One difference in rounding: in half precision the band's
scale is rounded to the query dtype before the level (q − 2^(b−1) + ½, exact) is multiplied by it and the product
rounded once (bands.dequantize's scale_dtype); the reference rounds the float32 product only.

A program owns (a few query tokens of one request, one KV head, one split of its context); its tile's rows are
(query token, GQA member) pairs, so each code is unpacked once for the whole group. The layer's heads come in a few
kinds (PageLayout.kinds: each chunk's width and where its planes and scales lie), compile-time constants: a program
branches once, on its head's kind, into a loop whose every unpacking is fixed, so the compiler sees all of a key
block's loads at once.

A key block of BLOCK_N tokens (starting at a multiple of BLOCK_N) is read as segments of whole pages (or of one
page, where a page is longer than a block): a plane's entries for a segment's tokens are contiguous in its page, so
one block-table entry and one 64-bit address a segment serve every load of a head, each plane and scale region at a
compile-time offset from the head's first plane (issue 50: per-token addresses went to pointer arithmetic and to
moving pointer vectors between layouts through shared memory; reading segments took the 4-bit loop at head_dim 128
from 5.30 to 4.69 instructions per number). Per chunk (8 or 16 dims): the chunk's plane words are made values in the
query dtype by triton_unpack (on CUDA two numbers a register: three instructions a pair), scaled by the token's band
scale byte c, s = 2^((c − 128)/8), once per (token, band). The chunks are joined (tl.join, then the join's index
moved first) into one [BLOCK_N, CH·NC] tile whose columns are the head's dims in order (a head over 64 dims has its
tiles, the same numbers, made by triton_tiles in the registers the warpgroup MMA reads instead), so each side is
one tl.dot and the queries and the output are read and written as they lie. Splits of a long context are merged
by triton_decode's combine kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels.triton_common import (
    check_query,
    dot_options,
    head_table,
    program_head,
    program_task,
    unit_columns,
)
from kvfold_runtime.kernels.triton_decode import _combine_kernel, _programs, default_splits
from kvfold_runtime.kernels.triton_tiles import mma_tile, tile_rows
from kvfold_runtime.kernels.triton_unpack import chunk_values, plane_words, scale_bytes
from kvfold_runtime.pages import page_layout

__all__ = ["history_parts", "paged_pages_attention"]

# Compiled for sm_90 (kvfold-bench kernels --aot sm_90): 4 warps over 64-token blocks (128 where a head is at most 64
# wide, so a block's softmax is shared by as many numbers) within 128 registers, four programs an SM; software
# pipelining (num_stages > 1) stages the words through shared memory and costs more instructions than it hides.
NUM_WARPS = 4
NUM_STAGES = 1
MAX_REGISTERS = 128
# a decode program's rows are its GQA group (4 for Llama-3-8B): 8 is the fewest the score product takes (the
# warpgroup MMA's N), where 16 would spend twice the softmax work on padding rows
MIN_ROWS = 8
# the shortest default split at decode: on an H200 (CUDA-graph replay, batch 1 × 4K, 4-bit Llama-3-8B layer) 16
# splits of 256 keys took 17 µs, 8 of 512 (triton_decode's length) 28 µs; at 32K and at batch 16 and 64 the splits
# are bounded by the device's programs, not by this
KEYS_PER_SPLIT = 256


def _block_n(head_dim: int) -> int:
    return 128 if head_dim <= 64 else 64


@triton.jit
def _chunk(base, first, valid, WIDTH: tl.constexpr, PLANE: tl.constexpr, SCALE: tl.constexpr, CH: tl.constexpr,
           PAGE: tl.constexpr, SEG: tl.constexpr, MASKED: tl.constexpr, OUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, CH] values of a chunk of CH dims in the query dtype OUT for a block of BLOCK_N tokens: WIDTH bits
    (0: the head has no such chunk, zeros), its first plane PLANE·PAGE bytes and its band's scale bytes SCALE·PAGE
    bytes after the head's first plane (PageLayout.kinds); base, first: the block's segments, at the head's first
    plane (triton_unpack.plane_words); valid [BLOCK_N]: the tokens the request has (MASKED: some have not, and what
    their rows hold is never made a value that could be NaN or infinite)."""
    if WIDTH == 0:
        return tl.zeros([BLOCK_N, CH], OUT)
    else:
        if WIDTH == 16:  # float16 values, dim 2w + h in lane h of word w: the natural order
            at = (base + (PLANE * PAGE + first * (2 * CH))).to(tl.pointer_type(tl.float16), bitcast=True)
            x = tl.reshape(tl.load(at[:, None] + tl.arange(0, SEG * CH)[None, :]), [BLOCK_N, CH]).to(OUT)
            if MASKED:  # an unwritten row may hold NaN
                x = tl.where(valid[:, None], x, 0.0)
            return x
        else:
            # the band's log8 scale byte (the chunks of one band read the same bytes: one load and one exp2 a band)
            byte = scale_bytes(base, first, SCALE * PAGE, SEG, BLOCK_N)
            if MASKED:  # an unwritten row's scale could overflow a float16 value: 1 instead
                byte = tl.where(valid, byte, 128)
            s = tl.exp2((byte.to(tl.float32) - 128.0) * 0.125)[:, None]
            HALF: tl.constexpr = (1 << (WIDTH - 1)) - 0.5
            P1: tl.constexpr = 8 if WIDTH == 8 else (4 if WIDTH >= 4 else 2)  # pages.PLANES
            P2: tl.constexpr = WIDTH - P1
            words = plane_words(base, first, PLANE * PAGE, P1, CH, SEG, BLOCK_N)
            hi_words = words
            if P2 > 0:
                hi_words = plane_words(base, first, PLANE * PAGE + PAGE * CH * P1 // 8, P2, CH, SEG, BLOCK_N)
            return chunk_values(words, hi_words, s, HALF, WIDTH, P1, P2, CH, OUT, BLOCK_N)


@triton.jit
def _tile(base, first, valid, KIND: tl.constexpr, SIDE: tl.constexpr, FIRST: tl.constexpr, COUNT: tl.constexpr,
          NC: tl.constexpr, CH: tl.constexpr, PAGE: tl.constexpr, SEG: tl.constexpr, MASKED: tl.constexpr,
          OUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Chunks FIRST … FIRST + COUNT − 1 of side SIDE (0 keys, 1 values; _step: which keys) of a head of kind
    KIND (a flat kind: _flat) side by side: [BLOCK_N, CH·COUNT], column j = the head's dim FIRST·CH + j (a join puts
    its new index last: it is moved first, which moves no data)."""
    if COUNT == 1:
        AT: tl.constexpr = 3 * NC * SIDE + FIRST
        return _chunk(base, first, valid, KIND[AT], KIND[AT + NC], KIND[AT + 2 * NC], CH, PAGE, SEG, MASKED, OUT,
                      BLOCK_N)
    else:
        a = _tile(base, first, valid, KIND, SIDE, FIRST, COUNT // 2, NC, CH, PAGE, SEG, MASKED, OUT, BLOCK_N)
        b = _tile(base, first, valid, KIND, SIDE, FIRST + COUNT // 2, COUNT // 2, NC, CH, PAGE, SEG, MASKED, OUT,
                  BLOCK_N)
        return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [BLOCK_N, CH * COUNT])


@triton.jit
def _step(cache_ptr, table_ptr, k_at, v_at, qt, m_i, l_i, acc, start, hi, qpos, r, stride_table, page_bytes,
          scale2, window, sinks, KIND: tl.constexpr, MASKED: tl.constexpr, WINDOWED: tl.constexpr,
          HISTORY: tl.constexpr, PAGE: tl.constexpr, NC: tl.constexpr, CH: tl.constexpr, VALUES: tl.constexpr,
          DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One key block [start, start + BLOCK_N) of the online softmax: (m, l, acc) updated. MASKED: keys past `hi`,
    after a row's query or outside its window are hidden (a block every row sees whole needs no mask); HISTORY: so
    are a windowed layer's whole keys (position < sinks or within `window` of the row's query). k_at, v_at:
    the head's first key and value plane in a page; KIND: the head's kind (PageLayout.kinds, flat: _flat)."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < hi
    SEG: tl.constexpr = min(PAGE, BLOCK_N)
    # the keys as the dot's first operand (BLOCK_N rows; sm_90 builds use its warpgroup MMA). Heads over 64 dims make
    # both tiles in the registers the MMA reads (triton_tiles; at head_dim 128, 4 bits: 4.16 instructions and 2.31
    # shared-memory bytes a number, 3.74 and 4.31 staged; 2-bit values 4.16 against 12.07); narrower ones stage them
    # (4.25 and 4.38 at 64, where the registers' way costs 4.92 for keys: each lane's own loads over 128-token blocks)
    if CH * NC > 64:
        at, tok, live = tile_rows(cache_ptr, table_ptr, r, stride_table, page_bytes, start, hi, PAGE, BLOCK_N)
        kt = mma_tile(at + k_at, tok, live, KIND, 0, NC, NC, CH, PAGE, MASKED, VALUES, BLOCK_N)
    else:
        # the block as segments of SEG tokens of one page each (start is a multiple of BLOCK_N): a segment's plane
        # entries are contiguous in its page; a page past the request's end reads as page 0 (any page will do)
        seg = start + tl.arange(0, BLOCK_N // SEG) * SEG
        page = tl.load(table_ptr + r.to(tl.int64) * stride_table + seg // PAGE, mask=seg < hi, other=0)
        base = cache_ptr + page.to(tl.int64) * page_bytes
        first = 0
        if SEG < PAGE:
            first = seg % PAGE
        kt = _tile(base + k_at, first, valid, KIND, 0, 0, NC, NC, CH, PAGE, SEG, MASKED, VALUES, BLOCK_N)
    s = tl.trans(tl.dot(kt, qt, input_precision=DOT_PREC)) * scale2  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        seen = valid[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOWED:
            seen = seen & (qpos[:, None] - pos[None, :] < window)
        if HISTORY:
            seen = seen & (pos[None, :] >= sinks) & (qpos[:, None] - pos[None, :] >= window)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that has seen no key yet: exp2 gives 0, not NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if CH * NC > 64:  # (transposed for their product, the values' tile goes through shared memory once)
        v = mma_tile(at + v_at, tok, live, KIND, 3 * NC, NC, NC, CH, PAGE, MASKED, VALUES, BLOCK_N)
    else:
        v = _tile(base + v_at, first, valid, KIND, 1, 0, NC, NC, CH, PAGE, SEG, MASKED, VALUES, BLOCK_N)
    p = p.to(DTYPE)  # as the reference: weights in the value dtype, float32 sums
    if UPCAST:
        p = p.to(tl.float32)
    # the output transposed, [BLOCK_D, BLOCK_M], so that the values are the first operand too: sm_90 builds then use
    # the warpgroup MMA for both products (with the 8 query rows first, Triton takes mma.sync: ~10% more per number)
    return m_new, l_i, acc * alpha[None, :] + tl.dot(tl.trans(v), tl.trans(p), input_precision=DOT_PREC)


@triton.jit
def _attend(q_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, k_at, v_at, table_ptr, stride_q, stride_o,
            page_bytes, stride_table, num_kv_heads, window, sinks, scaling, g, r, mb, sp, q_start, q_len, end, off_k,
            dk, off_v, dv, KIND: tl.constexpr, WINDOWED: tl.constexpr, HISTORY: tl.constexpr, GROUP: tl.constexpr,
            QUERIES: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, PARTS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NC: tl.constexpr, CH: tl.constexpr, DOT_PREC: tl.constexpr,
            UPCAST: tl.constexpr):
    """One program's attention for a head of kind KIND (PageLayout.kinds: each chunk's width and where its planes
    and scales lie): every unpacking and every offset but the head's own (k_at, v_at) is fixed at compile time.
    HISTORY: a windowed layer's codes part only — keys at positions [sinks, query − window] — written as partial
    results (PARTS slots a row: the splits, and one the caller fills with the whole rows' part)."""
    BLOCK_D: tl.constexpr = CH * NC
    # the dtype values are made in: the query's (Triton's interpreter does bfloat16 arithmetic on raw bits: there,
    # float32, see triton_common.dot_options)
    VALUES: tl.constexpr = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    qi = mb * QUERIES + rows // GROUP
    j = rows % GROUP
    live = (rows < QUERIES * GROUP) & (qi < q_len)
    qpos = end - q_len + qi
    tok_q = (q_start + qi).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)  # the tile's columns are the head's dims
    q_at = q_ptr + tok_q[:, None] * stride_q + GROUP * off_k + j[:, None] * dk + dims[None, :]
    q = tl.load(q_at, mask=live[:, None] & (dims < dk)[None, :], other=0.0)  # [BLOCK_M, BLOCK_D], tile order
    if UPCAST:
        q = q.to(tl.float32)
    qt = tl.trans(q)

    first = end - q_len + mb * QUERIES
    hi = tl.minimum(first + QUERIES, end)
    lo = first * 0
    if WINDOWED:  # from the block the window's first key is in: blocks start at multiples of BLOCK_N
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    if HISTORY:  # codes from the block the first one after the sinks is in, to the last query's position − window
        lo = sinks // BLOCK_N * BLOCK_N
        hi = tl.maximum(hi - window, lo)
    chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = lo + sp * chunk
    hi = tl.minimum(lo + chunk, hi)

    scale2 = scaling * 1.4426950408889634  # scores in log2 units: exp2 needs no multiply of its own
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)  # transposed (_step)
    if QUERIES > 1 or WINDOWED:  # rows see different keys: every block masked (a decode compiles only the other)
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _step(cache_ptr, table_ptr, k_at, v_at, qt, m_i, l_i, acc, start, hi, qpos, r,
                                  stride_table, page_bytes, scale2, window, sinks, KIND, True, WINDOWED, HISTORY, PAGE,
                                  NC, CH, VALUES, q_ptr.dtype.element_ty, BLOCK_N, DOT_PREC, UPCAST)
    else:  # one query token: it sees every key but those past the split's end, in its last block (and the sinks)
        begin = lo
        if HISTORY:
            if lo < sinks and lo < hi:  # the block the sinks end in: they are hidden
                m_i, l_i, acc = _step(cache_ptr, table_ptr, k_at, v_at, qt, m_i, l_i, acc, lo, hi, qpos, r,
                                      stride_table, page_bytes, scale2, window, sinks, KIND, True, False, HISTORY,
                                      PAGE, NC, CH, VALUES, q_ptr.dtype.element_ty, BLOCK_N, DOT_PREC, UPCAST)
                begin = tl.minimum(lo + BLOCK_N, hi)
        full = begin + (hi - begin) // BLOCK_N * BLOCK_N
        for start in range(begin, full, BLOCK_N):
            m_i, l_i, acc = _step(cache_ptr, table_ptr, k_at, v_at, qt, m_i, l_i, acc, start, hi, qpos, r,
                                  stride_table, page_bytes, scale2, window, sinks, KIND, False, False, False, PAGE,
                                  NC, CH, VALUES, q_ptr.dtype.element_ty, BLOCK_N, DOT_PREC, UPCAST)
        if full < hi:
            m_i, l_i, acc = _step(cache_ptr, table_ptr, k_at, v_at, qt, m_i, l_i, acc, full, hi, qpos, r,
                                  stride_table, page_bytes, scale2, window, sinks, KIND, True, False, HISTORY, PAGE,
                                  NC, CH, VALUES, q_ptr.dtype.element_ty, BLOCK_N, DOT_PREC, UPCAST)

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = tl.trans(acc) / safe_l[:, None]
    if PARTS == 1:
        o_at = out_ptr + tok_q[:, None] * stride_o + GROUP * off_v + j[:, None] * dv + dims[None, :]
        tl.store(o_at, o.to(out_ptr.dtype.element_ty), mask=live[:, None] & (dims < dv)[None, :])
    else:  # partial results as triton_decode's combine kernel reads them, in dim order
        slot = (tok_q * num_kv_heads * GROUP + g * GROUP + j) * PARTS + sp
        tl.store(part_o_ptr + slot[:, None] * BLOCK_D + dims[None, :], o, mask=live[:, None])
        lse = tl.where(l_i > 0, m_i * 0.6931471805599453 + tl.log(safe_l), float("-inf"))  # natural log again
        tl.store(part_lse_ptr + slot, lse, mask=live)


@triton.jit
def _pages_kernel(q_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, heads_ptr, kinds_ptr, layout_ptr, seq_lens_ptr,
                  starts_ptr, table_ptr, stride_q, stride_o, page_bytes, stride_table, num_kv_heads, window, sinks,
                  scaling, KINDS: tl.constexpr, WINDOWED: tl.constexpr, HISTORY: tl.constexpr, GROUP: tl.constexpr,
                  QUERIES: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, PARTS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  NC: tl.constexpr, CH: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    mb, g, sp, r, q_start, q_len = program_task(starts_ptr, NUM_SPLITS)
    if mb * QUERIES >= q_len:  # the grid covers the longest request
        return
    off_k, dk, off_v, dv = program_head(heads_ptr, num_kv_heads, g)
    end = tl.load(seq_lens_ptr + r).to(tl.int32)
    kind = tl.load(kinds_ptr + g)
    # the head's first key and value plane in a page: chunk 0's offsets in the layout's table [2, G, 3, NC]
    k_at = tl.multiple_of(tl.load(layout_ptr + g * 3 * NC + NC), 16)
    v_at = tl.multiple_of(tl.load(layout_ptr + (num_kv_heads + g) * 3 * NC + NC), 16)
    # one branch per kind of head in the layer (a warp-uniform choice made once per program); the kind wrapped in
    # tl.constexpr: Triton 3.6 would pass an item of a constexpr tuple on as a run-time tuple
    for i in tl.static_range(len(KINDS)):
        if kind == i:
            _attend(q_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, k_at, v_at, table_ptr, stride_q,
                    stride_o, page_bytes, stride_table, num_kv_heads, window, sinks, scaling, g, r, mb, sp, q_start,
                    q_len, end, off_k, dk, off_v, dv, tl.constexpr(KINDS[i]), WINDOWED, HISTORY, GROUP, QUERIES,
                    PAGE, NUM_SPLITS, PARTS, BLOCK_M, BLOCK_N, NC, CH, DOT_PREC, UPCAST)


@functools.lru_cache(maxsize=256)
def _flat_kinds(layout) -> tuple[tuple[int, ...], ...]:
    """The layout's kinds of head, flat (_flat), once per layout: read on every launch."""
    return tuple(_flat(kind) for kind in layout.kinds()[0])


def _flat(kind: tuple) -> tuple[int, ...]:
    """A kind (PageLayout.kinds: six tuples over the tile's chunks) as one flat tuple, the form every supported Triton
    passes to a jitted function as a constexpr (Triton 3.6, torch 2.11's, rejects a tuple of tuples there)."""
    return tuple(x for part in kind for x in part)


def paged_pages_attention(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, dims: LayerDims, *, scaling: float,
                          sliding_window: int | None = None, out: torch.Tensor | None = None,
                          max_query_len: int | None = None, max_seq_len: int | None = None,
                          num_splits: int | None = None) -> torch.Tensor:
    """triton_bits.paged_bits_attention's contract over a cache in the page layout: query [T, Σ_h d_k(g(h))] ->
    [T, Σ_h d_v(g(h))], kv [num_blocks, (1,) P, C] uint8 whose blocks are pages.PageLayout(dims, P) pages."""
    if out is None:
        out = query.new_empty(query.shape[0], dims.out_width)
    _launch(query, kv, block_table, seq_lens, query_start_loc, dims, scaling, sliding_window, None, out,
            max_query_len, max_seq_len, num_splits)
    return out


def history_parts(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, dims: LayerDims, *, scaling: float, sinks: int, window: int,
                  max_query_len: int | None = None, max_seq_len: int | None = None,
                  num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A windowed bits layer's codes part over the page layout: each query (at position i) over the keys at
    positions [sinks, i − window] only -> partial results (o [T, H, S + 1, D] float32, each normalised over its own
    keys, in dim order up to the layout's tile width D; their log-sum-exps [T, H, S + 1] of the scaled scores, −inf
    where a part saw no key) over S context splits, the last slot left for the caller's whole rows' part (merged by
    kernels.paged_window.merge_parts)."""
    return _launch(query, kv, block_table, seq_lens, query_start_loc, dims, scaling, None, (sinks, window), None,
                   max_query_len, max_seq_len, num_splits)


def _launch(query, kv, block_table, seq_lens, query_start_loc, dims: LayerDims, scaling, sliding_window, history,
            out, max_query_len, max_seq_len, num_splits):
    """The page kernel over the step: into `out` (history None), or as partial results (history (sinks, window):
    history_parts)."""
    check_query(query, dims.d_k, dims.d_v, dims.group)
    blocks = kv.reshape(kv.shape[0], -1)
    layout = page_layout(dims, kv.shape[-2])
    if kv.dtype != torch.uint8 or blocks.shape[1] != layout.page * layout.row_bytes:
        raise ValueError(f"the paged cache must be uint8 pages of {layout.page} × {layout.row_bytes} bytes, got "
                         f"{kv.dtype} {tuple(kv.shape)}")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    max_query_len = max(1, int(max_query_len))
    if num_splits is None:
        num_splits = 1
        if max_query_len == 1:
            context = block_table.shape[1] * layout.page if max_seq_len is None else max_seq_len
            if sliding_window is not None:
                context = min(context, sliding_window)
            num_splits = default_splits(context, seq_lens.shape[0] * dims.num_kv_heads, _programs(str(query.device)),
                                        KEYS_PER_SPLIT)
    group, g_count, tokens = dims.group, dims.num_kv_heads, query.shape[0]
    nc, ch = layout.tile_chunks, layout.chunk
    queries = max(1, min(max_query_len, 64 // group)) if max_query_len > 1 else 1
    kinds = _flat_kinds(layout)
    parts = num_splits + (history is not None)
    if parts > 1:
        part_o = torch.empty(tokens, g_count * group, parts, nc * ch, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(tokens, g_count * group, parts, dtype=torch.float32, device=query.device)
    else:
        part_o = part_lse = out
    sinks, window = history if history is not None else (0, sliding_window or 0)
    grid = (triton.cdiv(max_query_len, queries), g_count * num_splits, seq_lens.shape[0])
    _pages_kernel[grid](
        unit_columns(query), blocks, out if out is not None else part_o, part_o, part_lse,
        head_table(dims.d_k, dims.d_v, query.device), layout.head_kinds(query.device), layout.table(query.device),
        seq_lens, query_start_loc, block_table, query.stride(0), 0 if out is None else out.stride(0),
        blocks.stride(0), block_table.stride(0), g_count, window, sinks, scaling, KINDS=kinds,
        WINDOWED=bool(sliding_window), HISTORY=history is not None, GROUP=group, QUERIES=queries, PAGE=layout.page,
        NUM_SPLITS=num_splits, PARTS=parts, BLOCK_M=max(MIN_ROWS, triton.next_power_of_2(queries * group)),
        BLOCK_N=_block_n(nc * ch), NC=nc, CH=ch, num_warps=NUM_WARPS, num_stages=NUM_STAGES, maxnreg=MAX_REGISTERS,
        **dot_options(_pages_kernel, query.dtype))
    if history is not None:
        return part_o, part_lse
    if num_splits > 1:
        _combine_kernel[(tokens, g_count * group)](
            part_o, part_lse, out, head_table(dims.d_k, dims.d_v, query.device), out.stride(0), g_count, GROUP=group,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_DV=nc * ch)
    return out
