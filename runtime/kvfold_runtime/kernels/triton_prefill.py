"""Causal flash-attention prefill in Triton over keys and values of uneven per-head widths.

Layouts are kvfold's packed ones (kvfold_runtime.format); paged mode reads the one paged layout described in
kvfold_runtime.kernels.paged, through the block table. The contract is reference_attention's (original
`scaling`, float32 softmax and accumulation, output in the query dtype, query head h reads KV head h // group).

A batch of requests of any query lengths (query_start_loc, as vLLM describes them): each request's queries are
the last tokens of its sequence, so a chunked prefill attends to its whole cached prefix, causally aligned to the
last query, optionally within a sliding window. A program owns (block of query rows, query head, request); it
skips the key blocks that the causal mask and the window hide entirely. Tiles are sized for the widest head and
masked per head, with offsets and widths from triton_common.head_table.

prefill_attention takes an explicit `mask` too (as transformers passes one: kvfold_runtime.kernels.masks), which
replaces the causal / window / seq_lens masking: every key is a candidate, no key block is skipped for causality,
and the mask alone decides (constexpr HAS_MASK; read as in triton_decode). A key block that the mask hides from
all of the program's query rows is skipped: it would add nothing. A row with no key to attend to gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfold_runtime.kernels.triton_common import (
    check_paged,
    check_query,
    dot_options,
    head_table,
    mask_args,
    tile,
    unit_columns,
)

__all__ = ["paged_prefill_attention", "prefill_attention"]

BLOCK_M = 32  # query rows per program
BLOCK_N = 32  # keys per loop iteration


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, heads_ptr, seq_lens_ptr, starts_ptr, table_ptr, mask_ptr, stride_q,
                    stride_o, stride_k0, stride_k1, stride_v0, stride_v1, stride_table, stride_mb, stride_mh,
                    stride_mt, stride_ms, num_kv_heads, window, scaling, GROUP: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                    PAGED: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, DOT_PREC: tl.constexpr,
                    UPCAST: tl.constexpr):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2)
    q_start = tl.load(starts_ptr + r).to(tl.int32)
    q_len = tl.load(starts_ptr + r + 1).to(tl.int32) - q_start
    if mb * BLOCK_M >= q_len:  # the grid covers the longest request
        return
    g = h // GROUP
    j = h % GROUP
    off_k = tl.load(heads_ptr + g)
    dk = tl.load(heads_ptr + num_kv_heads + g)
    off_v = tl.load(heads_ptr + 2 * num_kv_heads + g)
    dv = tl.load(heads_ptr + 3 * num_kv_heads + g)
    end = tl.load(seq_lens_ptr + r).to(tl.int32)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the request
    live = rows < q_len
    qpos = end - q_len + rows  # the queries are the last q_len tokens of the sequence
    cols_k = tl.arange(0, BLOCK_DK)
    cols_v = tl.arange(0, BLOCK_DV)
    keys = tl.arange(0, BLOCK_N)
    in_k = cols_k < dk
    in_v = cols_v < dv
    q_rows = (q_start + rows).to(tl.int64)
    q_at = q_ptr + q_rows[:, None] * stride_q + GROUP * off_k + j * dk + cols_k[None, :]
    q = tl.load(q_at, mask=live[:, None] & in_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_DK]
    if UPCAST:  # see dot_options
        q = q.to(tl.float32)

    if HAS_MASK:  # the mask decides: every key is a candidate
        lo = end * 0
        hi = end
    else:
        first = end - q_len + mb * BLOCK_M
        hi = tl.minimum(first + BLOCK_M, end)  # past the block's last query: hidden by causality
        lo = first * 0
        if window > 0:
            lo = tl.maximum(first - window + 1, 0)  # before the block's first query's window: hidden
    # this program's mask rows (read only with HAS_MASK)
    m_rows = mask_ptr + r.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + rows[:, None].to(tl.int64) * stride_mt
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
            work = tl.max(seen.to(tl.int32)) > 0  # a block the mask hides from every row adds nothing: skip it
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
            kt_at = k_ptr + major[None, :] * stride_k0 + minor[None, :] * stride_k1 + off_k + cols_k[:, None]
            kt = tl.load(kt_at, mask=in_k[:, None] & valid[None, :], other=0.0)  # [BLOCK_DK, BLOCK_N]
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
            v_at = v_ptr + major[:, None] * stride_v0 + minor[:, None] * stride_v1 + off_v + cols_v[None, :]
            v = tl.load(v_at, mask=valid[:, None] & in_v[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
            p = p.to(v.dtype)  # as the reference: weights in the value dtype, float32 sums
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
            m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with nothing to attend to (masked) gives 0
    o_at = out_ptr + q_rows[:, None] * stride_o + GROUP * off_v + j * dv + cols_v[None, :]
    tl.store(o_at, o.to(out_ptr.dtype.element_ty), mask=live[:, None] & in_v[None, :])


def _launch(q, k, v, out, seq_lens, starts, table, page, d_k, d_v, group, scaling, window, max_query_len,
            mask=None):
    """q [T, Σ_h d_k] (requests concatenated at `starts`), out [T, Σ_h d_v]; k / v addressed as
    major·stride0 + minor·stride1 + column, (major, minor) = (request, position) or, through `table`,
    (block, position in block). `mask`: triton_common.mask_args' triple, or None."""
    mask_t, mask_strides, mask_bool = mask or (seq_lens, (0, 0, 0, 0), True)  # seq_lens: never read
    paged = table is not None
    if not paged:
        table = seq_lens  # never read
    g_count = len(d_k)
    grid = (triton.cdiv(max_query_len, BLOCK_M), g_count * group, seq_lens.shape[0])
    _prefill_kernel[grid](
        q, k, v, out, head_table(d_k, d_v, q.device), seq_lens, starts, table, mask_t, q.stride(0), out.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), table.stride(0), *mask_strides, g_count, window,
        scaling, GROUP=group, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_DK=tile(max(d_k)),
        BLOCK_DV=tile(max(d_v)), PAGED=paged, HAS_MASK=mask is not None, MASK_BOOL=mask_bool,
        **dot_options(_prefill_kernel, q.dtype))
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k, d_v, group: int, *, scaling: float,
                      seq_lens: torch.Tensor | None = None, sliding_window: int | None = None,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, Σ_h d_k], k [B, S, Σd_k], v [B, S, Σd_v] (T ≤ S) -> [B, T, Σ_h d_v]: causal, the T queries
    being the last T of each sequence's seq_lens[b] tokens (default S); a query at position i sees keys
    i − W + 1 … i with `sliding_window` W.

    `mask` (as transformers passes one; reference_attention's semantics) replaces all of that: bool
    [B|1, H|1, T|1, ≥S] (True = attend) or float (added to the scores), only its first S key columns read
    (triton_common.mask_problem lists what is taken). A query row with no key to attend to (left padding)
    gives 0, as torch's SDPA."""
    check_query(q, d_k, d_v, group)
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    if mask is not None:
        if seq_lens is not None or sliding_window is not None:
            raise ValueError("pass a mask or seq_lens / sliding_window, not both: the mask alone decides")
        mask = mask_args(mask, b, group * len(d_k), t, s, q.device)
    elif t > s:
        raise ValueError(f"{t} queries but {s} keys: the queries must be the last tokens of the cached sequence")
    if seq_lens is None:
        seq_lens = torch.full((b,), s, dtype=torch.int32, device=q.device)
    starts = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    out = q.new_empty(b * t, group * sum(d_v))
    _launch(unit_columns(q.reshape(b * t, -1)), unit_columns(k), unit_columns(v), out, seq_lens, starts, None, 1,
            d_k, d_v, group, scaling, sliding_window or 0, t, mask)
    return out.view(b, t, -1)


def paged_prefill_attention(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, d_k, d_v, group: int, *,
                            scaling: float, sliding_window: int | None = None, max_query_len: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Σ_h d_k] -> [T, Σ_h d_v]: the requests' queries (query_start_loc [R + 1]) over their cached
    tokens in kv [num_blocks, (1,) block_size, Σd_k + Σd_v] (kvfold_runtime.kernels.paged), as
    paged_attention computes it. max_query_len (vLLM knows it) sizes the grid; without it, one host sync."""
    check_query(query, d_k, d_v, group)
    check_paged(query, kv, out)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])  # [num_blocks, block_size, C], a view
    if out is None:
        out = query.new_empty(query.shape[0], group * sum(d_v))
    values = blocks[..., sum(d_k):]  # same rows, addressed from the first value column
    _launch(unit_columns(query), blocks, values, out, seq_lens, query_start_loc, block_table, blocks.shape[1], d_k,
            d_v, group, scaling, sliding_window or 0, max(1, max_query_len))
    return out
