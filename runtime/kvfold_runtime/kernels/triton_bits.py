"""Flash attention in Triton over a bits-format cache: the kernels load the band codes (uint8 rows,
kvfold_runtime.bands) and dequantize them in registers, tile by tile; no dequantized copy of the cache is made.

A cached token's row in one layer is `encode_heads(k, d_k, k_bands) ++ encode_heads(v, d_v, v_bands)`
(LayerDims.row_bytes() bytes: keys then values). Two address modes (constexpr PAGED), as the rank-format kernels
(triton_decode.py, triton_prefill.py):
  contiguous  keys rows [B, S, K_bytes] and values rows [B, S, V_bytes] uint8 (a transformers cache layer,
              [B, 1, S, ·], is taken too);
  paged       one uint8 tensor [num_blocks, (1,) block_size, K_bytes + V_bytes], addressed through vLLM's
              block_table / seq_lens / query_start_loc exactly as kvfold_runtime.kernels.paged describes.
Queries and outputs keep kvfold's packed float layouts [.., Σ_h d_k(g(h))] and [.., Σ_h d_v(g(h))]. The contract
is the transformers runtime's for a bits export: keys and values read back as decode_heads gives them, in the
query's dtype, then reference_attention (the model's `scaling`, float32 softmax and accumulation, output in the
query dtype, query head h reads KV head h // group), causal with the queries the last tokens of each sequence,
optionally within a sliding window or under an explicit mask (contiguous mode, as transformers passes one).

One kernel serves decode, prefill and chunked prefill. A program owns (a few query tokens of one request, one KV
head, one split of the context): its tile's rows are (query token, member of the GQA group) pairs, so the
dequantized keys and values, the costly part here, are computed once for the whole group. Per key block it
gathers each (token, dim) code through the layer's tables (bits_table: byte, shift, width, scale), turns it into
x̂ = (q + ½ − 2^(b−1))·s (or a float16 value for 16-bit bands), rounds it to the query dtype (what decode_heads
hands attention) and runs the online softmax of triton_prefill. Decode batches split long contexts
(flash-decoding, triton_decode.default_splits) and merge the splits with triton_decode's combine kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels import bits_table
from kvfold_runtime.kernels.triton_common import (
    check_query,
    dot_options,
    head_table,
    mask_args,
    program_head,
    program_task,
    tile,
    unit_columns,
)
from kvfold_runtime.kernels.triton_decode import _combine_kernel, _programs, default_splits

__all__ = ["bits_attention", "paged_bits_attention"]

NUM_WARPS = 8


def _tiles(max_query_len: int, group: int, block_d: int) -> tuple[int, int]:
    """(query tokens per program, keys per loop iteration). Dequantizing holds a few int32 and 64-bit address
    registers per (key, dim) of the tile, so key blocks are short: with 8 warps these keep sm_90 builds (ptxas)
    within the registers, or spilling little, for head widths up to 128 (up to 256: a few hundred bytes). A
    prefill program takes up to 64 (query token, group member) rows (32 past width 128): the dequantized keys
    and values serve them all; a decode program takes one token's group."""
    rows = 64 if block_d <= 128 else 32
    queries = max(1, min(int(max_query_len), rows // group))
    return queries, 32 if queries * group <= 16 and block_d <= 128 else 16


@triton.jit
def _half(word):
    """The float16 whose bits are the low 16 bits of the int32 `word`, as float32."""
    return word.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequantize(rows_ptr, row_at, valid, where, scale):
    """Float32 values of a tile of cached codes. Every argument broadcasts to the tile's shape: row_at (int64)
    is each token's row offset in bytes, `valid` the tokens to read, `where` and `scale` the dims' two table words
    (bits_table: byte << 8 | shift << 5 | bits, and scale_at << 2 | kind). Dims no band holds (bits 0) and tokens
    not valid read as 0."""
    bits = where & 31
    shift = (where >> 5) & 7
    kind = scale & 3
    kept = valid & (bits > 0)
    at = rows_ptr + row_at + (where >> 8)
    # the code's 16-bit little-endian window; its second byte is read only where the code reaches into it
    # (the window may end past the row, even past the tensor)
    lo = tl.load(at, mask=kept, other=0).to(tl.int32)
    hi = tl.load(at + 1, mask=kept & (shift + bits > 8), other=0).to(tl.int32)
    word = lo | (hi << 8)
    code = (word >> shift) & ((1 << bits) - 1)
    level = code.to(tl.float32) + 0.5 - (1 << tl.maximum(bits - 1, 0)).to(tl.float32)  # mid-rise, symmetric
    # the band's scale: one byte c (log8, s = 2^((c − 128)/8)) or a little-endian float16
    s_at = rows_ptr + row_at + (scale >> 2)
    s0 = tl.load(s_at, mask=kept & (kind > 0), other=0).to(tl.int32)
    s1 = tl.load(s_at + 1, mask=kept & (kind == 2), other=0).to(tl.int32)
    s = tl.where(kind == 2, _half(s0 | (s1 << 8)), tl.exp2((s0.to(tl.float32) - 128.0) * 0.125))
    x = tl.where(bits == 16, _half(word), level * s)
    return tl.where(kept, x, 0.0)


@triton.jit
def _bits_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, heads_ptr, k_table_ptr, v_table_ptr,
                 seq_lens_ptr, starts_ptr, table_ptr, mask_ptr, stride_q, stride_o, stride_k0, stride_k1, stride_v0,
                 stride_v1, stride_table, stride_mb, stride_mh, stride_mt, stride_ms, num_kv_heads, window, scaling,
                 GROUP: tl.constexpr, QUERIES: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 PAGED: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    mb, g, sp, r, q_start, q_len = program_task(starts_ptr, NUM_SPLITS)
    if mb * QUERIES >= q_len:  # the grid covers the longest request
        return
    off_k, dk, off_v, dv = program_head(heads_ptr, num_kv_heads, g)
    end = tl.load(seq_lens_ptr + r).to(tl.int32)

    rows = tl.arange(0, BLOCK_M)
    qi = mb * QUERIES + rows // GROUP  # the row's query token within the request
    j = rows % GROUP  # its member of the GQA group: query head g·GROUP + j
    live = (rows < QUERIES * GROUP) & (qi < q_len)
    qpos = end - q_len + qi  # the queries are the last q_len tokens of the sequence
    tok = (q_start + qi).to(tl.int64)
    cols_k = tl.arange(0, BLOCK_DK)
    cols_v = tl.arange(0, BLOCK_DV)
    keys = tl.arange(0, BLOCK_N)
    in_v = cols_v < dv
    # query head g·GROUP + j sits at columns GROUP·off_k + j·dk of the packed query row
    q_at = q_ptr + tok[:, None] * stride_q + GROUP * off_k + j[:, None] * dk + cols_k[None, :]
    q = tl.load(q_at, mask=live[:, None] & (cols_k < dk)[None, :], other=0.0)  # [BLOCK_M, BLOCK_DK]
    if UPCAST:  # see triton_common.dot_options
        q = q.to(tl.float32)
    # this head's rows of the [G, 2, BLOCK_D] tables (bits_table); read again in every iteration of the key loop
    # (from the cache) rather than held in registers across it
    k_words = k_table_ptr + g * 2 * BLOCK_DK + cols_k
    v_words = v_table_ptr + g * 2 * BLOCK_DV + cols_v

    if HAS_MASK:  # the mask decides: every key is a candidate
        lo = end * 0
        hi = end
    else:
        first = end - q_len + mb * QUERIES  # the program's first query's position
        hi = tl.minimum(first + QUERIES, end)  # past its last query: hidden by causality
        lo = first * 0
        if window > 0:
            lo = tl.maximum(first - window + 1, 0)  # before its first query's window: hidden
    # this split's share of [lo, hi), in whole key blocks
    chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = lo + sp * chunk
    hi = tl.minimum(lo + chunk, hi)
    # the mask row of each (query token, head) row (read only with HAS_MASK)
    m_rows = (mask_ptr + r.to(tl.int64) * stride_mb + (g * GROUP + j)[:, None].to(tl.int64) * stride_mh
              + qi[:, None].to(tl.int64) * stride_mt)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + keys
        valid = pos < hi
        if HAS_MASK:
            m_at = m_rows + pos[None, :].to(tl.int64) * stride_ms
            if MASK_BOOL:
                seen = tl.load(m_at, mask=live[:, None] & valid[None, :], other=0) != 0  # [BLOCK_M, BLOCK_N]
            else:
                bias = tl.load(m_at, mask=live[:, None] & valid[None, :], other=float("-inf")).to(tl.float32)
                seen = bias > float("-inf")
            work = tl.max(seen.to(tl.int32)) > 0  # a block the mask hides from every row adds nothing
        else:
            seen = valid[None, :] & (pos[None, :] <= qpos[:, None])
            if window > 0:
                seen = seen & (qpos[:, None] - pos[None, :] < window)
            work = True
        if work:
            if PAGED:
                page = tl.load(table_ptr + r.to(tl.int64) * stride_table + pos // PAGE, mask=valid, other=0)
                major = page.to(tl.int64)
                minor = (pos % PAGE).to(tl.int64)
            else:
                major = r.to(tl.int64) + keys * 0
                minor = pos.to(tl.int64)
            # keys, transposed [BLOCK_DK, BLOCK_N], in the query dtype as decode_heads would hand them over
            kt = _dequantize(k_ptr, (major * stride_k0 + minor * stride_k1)[None, :], valid[None, :],
                             tl.load(k_words)[:, None], tl.load(k_words + BLOCK_DK)[:, None])
            kt = kt.to(q_ptr.dtype.element_ty)
            if UPCAST:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PREC) * scaling  # [BLOCK_M, BLOCK_N] float32
            if HAS_MASK and not MASK_BOOL:
                s = s + bias
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf: shift by 0 instead, so exp gives 0, not NaN
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _dequantize(v_ptr, (major * stride_v0 + minor * stride_v1)[:, None], valid[:, None],
                            tl.load(v_words)[None, :], tl.load(v_words + BLOCK_DV)[None, :])
            v = v.to(q_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_DV]
            p = p.to(v.dtype)  # as the reference: weights in the value dtype, float32 sums
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
            m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)  # an empty split, or a row with nothing to attend to, gives 0
    o = acc / safe_l[:, None]
    if NUM_SPLITS == 1:
        o_at = out_ptr + tok[:, None] * stride_o + GROUP * off_v + j[:, None] * dv + cols_v[None, :]
        tl.store(o_at, o.to(out_ptr.dtype.element_ty), mask=live[:, None] & in_v[None, :])
    else:  # partial results, laid out as triton_decode's combine kernel reads them (a query token for a request)
        slot = (tok * num_kv_heads * GROUP + g * GROUP + j) * NUM_SPLITS + sp  # [BLOCK_M]
        tl.store(part_o_ptr + slot[:, None] * BLOCK_DV + cols_v[None, :], o, mask=live[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        tl.store(part_lse_ptr + slot, lse, mask=live)


def _launch(q, k, v, out, dims: LayerDims, seq_lens, starts, table, page, scaling, window, max_query_len,
            num_splits, mask=None):
    """q [T, Σ_h d_k] (requests concatenated at `starts`), out [T, Σ_h d_v]; the uint8 rows k / v addressed as
    major·stride0 + minor·stride1 + byte, (major, minor) = (request, position) or, through `table`, (block,
    position in block). `mask`: triton_common.mask_args' triple, or None."""
    mask_t, mask_strides, mask_bool = mask or (seq_lens, (0, 0, 0, 0), True)  # seq_lens: never read
    paged = table is not None
    if not paged:
        table = seq_lens  # never read
    group, g_count, tokens = dims.group, dims.num_kv_heads, q.shape[0]
    block_dk, block_dv = tile(max(dims.d_k)), tile(max(dims.d_v))
    queries, block_n = _tiles(max_query_len, group, max(block_dk, block_dv))
    heads = head_table(dims.d_k, dims.d_v, q.device)
    k_table, v_table = bits_table.layer_tables(dims, q.device)
    if num_splits > 1:
        part_o = torch.empty(tokens, g_count * group, num_splits, block_dv, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, g_count * group, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused: the single split writes the output itself
    grid = (triton.cdiv(max_query_len, queries), g_count * num_splits, seq_lens.shape[0])
    _bits_kernel[grid](
        q, k, v, out, part_o, part_lse, heads, k_table, v_table, seq_lens, starts, table, mask_t, q.stride(0),
        out.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), table.stride(0), *mask_strides, g_count,
        window, scaling, GROUP=group, QUERIES=queries, PAGE=page, NUM_SPLITS=num_splits,
        BLOCK_M=tile(queries * group), BLOCK_N=block_n, BLOCK_DK=block_dk, BLOCK_DV=block_dv, PAGED=paged,
        HAS_MASK=mask is not None, MASK_BOOL=mask_bool, num_warps=NUM_WARPS, **dot_options(_bits_kernel, q.dtype))
    if num_splits > 1:
        _combine_kernel[(tokens, g_count * group)](
            part_o, part_lse, out, heads, out.stride(0), g_count, GROUP=group, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_DV=block_dv)
    return out


def _check_layer(q: torch.Tensor, dims: LayerDims) -> tuple[int, int]:
    """ValueError (with the fix) unless `dims` is a bits-format layer whose widths describe q; its row bytes."""
    if not dims.banded:
        raise ValueError("the bits kernels read bits-format caches; this layer stores its keys and values as they "
                         "are: use decode_attention / prefill_attention")
    check_query(q, dims.d_k, dims.d_v, dims.group)
    return dims.row_bytes()


def _check_rows(rows: torch.Tensor, width: int, what: str) -> None:
    if rows.dtype != torch.uint8 or rows.shape[-1] != width:
        raise ValueError(f"{what} must be uint8 rows of {width} bytes (LayerDims.row_bytes(), encode_heads), got "
                         f"{rows.dtype} rows of {rows.shape[-1]}: is this layer's cache a bits-format export's?")
    if rows.stride(-1) != 1:
        raise ValueError(f"{what} need contiguous rows (stride 1 along the last dimension)")


def bits_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, dims: LayerDims, *,
                   scaling: float, seq_lens: torch.Tensor | None = None, sliding_window: int | None = None,
                   mask: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """q [B, T, Σ_h d_k(g(h))] over a contiguous bits-format cache -> [B, T, Σ_h d_v(g(h))] in q's dtype.
    k_rows [B, S, K_bytes], v_rows [B, S, V_bytes] uint8 (encode_heads' rows; a transformers cache layer
    [B, 1, S, ·] is taken as it is). Causal: the T queries are the last T of each sequence's seq_lens[b] tokens
    (default S); a query at position i sees keys i − W + 1 … i with `sliding_window` W. T = 1 is decode.

    `mask` (as transformers passes one; reference_attention's semantics) replaces seq_lens and the window: bool
    [B|1, H|1, T|1, ≥S] (True = attend) or float (added to the scores), only its first S key columns read
    (triton_common.mask_problem lists what is taken). A query row with no key to attend to gives 0, as torch's
    SDPA. num_splits: context splits per sequence (default: by context length for decode, 1 for prefill)."""
    k_bytes, v_bytes = _check_layer(q, dims)
    rows = []
    for x, width, what in ((k_rows, k_bytes, "k_rows"), (v_rows, v_bytes, "v_rows")):
        if x.dim() == 4:
            if x.shape[1] != 1:
                raise ValueError(f"{what} of shape {tuple(x.shape)}: a bits-format cache layer is [B, 1, S, bytes]")
            x = x[:, 0]
        _check_rows(x, width, what)
        rows.append(x)
    b, t, s = q.shape[0], q.shape[1], rows[0].shape[1]
    if mask is not None:
        if seq_lens is not None or sliding_window is not None:
            raise ValueError("pass a mask or seq_lens / sliding_window, not both: the mask alone decides")
        mask = mask_args(mask, b, dims.group * dims.num_kv_heads, t, s, q.device)
    elif t > s:
        raise ValueError(f"{t} queries but {s} keys: the queries must be the last tokens of the cached sequence")
    if seq_lens is None:
        seq_lens = torch.full((b,), s, dtype=torch.int32, device=q.device)
    if num_splits is None:
        context = s if sliding_window is None else min(s, sliding_window)
        num_splits = default_splits(context, b * dims.num_kv_heads, _programs(str(q.device))) if t == 1 else 1
    starts = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    out = q.new_empty(b * t, dims.out_width)
    _launch(unit_columns(q.reshape(b * t, -1)), *rows, out, dims, seq_lens, starts, None, 1, scaling,
            sliding_window or 0, t, num_splits, mask)
    return out.view(b, t, -1)


def paged_bits_attention(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, dims: LayerDims, *, scaling: float,
                         sliding_window: int | None = None, out: torch.Tensor | None = None,
                         max_query_len: int | None = None, max_seq_len: int | None = None,
                         num_splits: int | None = None) -> torch.Tensor:
    """query [T, Σ_h d_k(g(h))] -> [T, Σ_h d_v(g(h))] in query's dtype (written into `out` if given): the
    requests' queries (query_start_loc [R + 1], int32) over their cached tokens (seq_lens [R], the new ones
    included) in the paged bits-format cache kv [num_blocks, (1,) block_size, K_bytes + V_bytes] uint8 (a token's
    row: encode_heads of its keys, then of its values), slots through block_table [R, max_blocks]
    (kvfold_runtime.kernels.paged). Decodes, prefills and chunked prefills, mixed in one batch.

    max_query_len (vLLM knows it) sizes the grid; without it, one host sync. max_seq_len bounds seq_lens
    (default: the block table's capacity) and, for a decode-only batch (max_query_len 1), sets how many splits
    each context gets (num_splits; default 1 otherwise). Rows of `out` past query_start_loc[-1] (a batch padded
    for CUDA graphs) are not results: left as they were with one split, overwritten with several."""
    k_bytes, v_bytes = _check_layer(query, dims)
    blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])  # [num_blocks, block_size, K_bytes + V_bytes], a view
    _check_rows(blocks, k_bytes + v_bytes, "the paged cache kv")
    if out is not None and (out.shape != (query.shape[0], dims.out_width) or out.stride(-1) != 1):
        raise ValueError(f"`out` must be [{query.shape[0]}, {dims.out_width}] with contiguous rows")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    max_query_len = max(1, int(max_query_len))
    page = blocks.shape[1]
    if num_splits is None:
        num_splits = 1
        if max_query_len == 1:
            context = block_table.shape[1] * page if max_seq_len is None else max_seq_len
            if sliding_window is not None:
                context = min(context, sliding_window)
            num_splits = default_splits(context, seq_lens.shape[0] * dims.num_kv_heads, _programs(str(query.device)))
    if out is None:
        out = query.new_empty(query.shape[0], dims.out_width)
    values = blocks[..., k_bytes:]  # same rows, addressed from the first value byte
    _launch(unit_columns(query), blocks, values, out, dims, seq_lens, query_start_loc, block_table, page, scaling,
            sliding_window or 0, max_query_len, num_splits)
    return out
