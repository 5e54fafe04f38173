"""Flash-decoding in Triton: one new query token per sequence, over keys and values of uneven per-head widths.

Layouts are kvfold's packed ones (kvfold_runtime.format) and, in paged mode, the one paged layout described in
kvfold_runtime.kernels.paged (rows [k'_0 | … | k'_{G-1} | v'_0 | … | v'_{G-1}], slots through the block table).
The contract is reference_attention's: scores q·k × `scaling` (the original model's), float32 softmax and
accumulation, output in the query dtype; query head h reads KV head h // group.

One kernel, two address modes (constexpr PAGED): a program owns one (sequence, KV head, split of the context)
task. It loads that KV head's key and value rows once for all `group` query heads of the GQA group, keeps a
running max / sum / accumulator in float32 and writes a partial result; _combine_kernel merges the splits with
the log-sum-exp trick. Heads differ in width, so tiles are sized for the widest head (powers of two, at least
16 for tl.dot) and masked per head; per-head offsets and widths come from a small int32 table (head_table).

balanced=True (load balancing, FDC §5.3): task costs differ (context length × (d_k + d_v)), so the tasks are
sorted by cost on the device and a persistent grid of P programs walks the sorted list in snake order (LPT-like),
so programs finish together. Each task computes exactly what it computes in the plain grid: same results.

An explicit `mask` (decode_attention's, as transformers passes one: kvfold_runtime.kernels.masks) replaces the
seq_lens / window masking: every key is a candidate and the mask alone decides (constexpr HAS_MASK; a bool mask is
read as bytes, True = attend, a float one is added to the scores; broadcast dimensions read with stride 0). A key
block the mask hides from all the task's query heads is skipped (it would add nothing). A query head with no key
to attend to gives 0, as torch's scaled_dot_product_attention does (reference_attention averages the values).
"""

from __future__ import annotations

import functools

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

__all__ = ["decode_attention", "default_splits", "paged_decode_attention"]

KEYS_PER_SPLIT = 512  # shortest default split: long enough to amortise writing and merging a partial result
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # enough resident programs per SM to hide memory latency
BLOCK_N = 64  # keys per loop iteration


@triton.jit
def _decode_task(r, g, sp, q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, heads_ptr, seq_lens_ptr,
                 table_ptr, mask_ptr, stride_q, stride_o, stride_k0, stride_k1, stride_v0, stride_v1, stride_table,
                 stride_mb, stride_mh, stride_ms, num_kv_heads, window, scaling, GROUP: tl.constexpr,
                 PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PAGED: tl.constexpr, HAS_MASK: tl.constexpr,
                 MASK_BOOL: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    off_k = tl.load(heads_ptr + g)
    dk = tl.load(heads_ptr + num_kv_heads + g)
    off_v = tl.load(heads_ptr + 2 * num_kv_heads + g)
    dv = tl.load(heads_ptr + 3 * num_kv_heads + g)
    end = tl.load(seq_lens_ptr + r).to(tl.int32)
    begin = end * 0
    if window > 0:
        begin = tl.maximum(end - window, 0)
    # this sequence's context split in NUM_SPLITS chunks of whole key blocks
    chunk = tl.cdiv(tl.cdiv(end - begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = begin + sp * chunk
    hi = tl.minimum(lo + chunk, end)

    rows = tl.arange(0, BLOCK_G)  # query heads of the group
    cols_k = tl.arange(0, BLOCK_DK)
    cols_v = tl.arange(0, BLOCK_DV)
    keys = tl.arange(0, BLOCK_N)
    in_k = cols_k < dk
    in_v = cols_v < dv
    head = g * GROUP + rows
    live = rows < GROUP
    # query head g·GROUP + j sits at columns GROUP·off_k + j·dk of the packed query row
    q_at = q_ptr + r.to(tl.int64) * stride_q + GROUP * off_k + rows[:, None] * dk + cols_k[None, :]
    q = tl.load(q_at, mask=live[:, None] & in_k[None, :], other=0.0)  # [BLOCK_G, BLOCK_DK]
    if UPCAST:  # see dot_options
        q = q.to(tl.float32)
    # the mask row of each query head of the group (read only with HAS_MASK)
    m_row = mask_ptr + r.to(tl.int64) * stride_mb + head[:, None].to(tl.int64) * stride_mh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + keys
        valid = pos < hi
        if HAS_MASK:
            m_at = m_row + pos[None, :].to(tl.int64) * stride_ms
            if MASK_BOOL:
                seen = tl.load(m_at, mask=live[:, None] & valid[None, :], other=0) != 0  # [BLOCK_G, BLOCK_N]
            else:
                bias = tl.load(m_at, mask=live[:, None] & valid[None, :], other=float("-inf")).to(tl.float32)
                seen = bias > float("-inf")
            work = tl.max(seen.to(tl.int32)) > 0  # a block the mask hides from every head adds nothing
        else:
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
            s = tl.dot(q, kt, input_precision=DOT_PREC) * scaling  # [BLOCK_G, BLOCK_N] float32
            if HAS_MASK:
                if MASK_BOOL:
                    s = tl.where(seen, s, float("-inf"))
                else:
                    s = tl.where(seen, s + bias, float("-inf"))
            else:
                s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet (masked) keeps m = -inf: shift by 0 instead, so exp gives 0, not NaN
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

    safe_l = tl.where(l_i > 0, l_i, 1.0)  # an empty split (or sequence, or fully masked row) contributes nothing
    o = acc / safe_l[:, None]
    if NUM_SPLITS == 1:
        o_at = out_ptr + r.to(tl.int64) * stride_o + GROUP * off_v + rows[:, None] * dv + cols_v[None, :]
        tl.store(o_at, o.to(out_ptr.dtype.element_ty), mask=live[:, None] & in_v[None, :])
    else:
        slot = (r.to(tl.int64) * num_kv_heads * GROUP + head) * NUM_SPLITS + sp  # [BLOCK_G]
        tl.store(part_o_ptr + slot[:, None] * BLOCK_DV + cols_v[None, :], o, mask=live[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        tl.store(part_lse_ptr + slot, lse, mask=live)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, heads_ptr, seq_lens_ptr, table_ptr,
                   order_ptr, mask_ptr, stride_q, stride_o, stride_k0, stride_k1, stride_v0, stride_v1, stride_table,
                   stride_mb, stride_mh, stride_ms, num_kv_heads, num_tasks, num_programs, window, scaling,
                   GROUP: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PAGED: tl.constexpr,
                   BALANCED: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, DOT_PREC: tl.constexpr,
                   UPCAST: tl.constexpr):
    if BALANCED:
        # persistent program: in round k it takes the k-th P-slice of the cost-sorted tasks, alternating the
        # direction (snake), so the costliest tasks spread over all programs and their sums even out
        pid = tl.program_id(0)
        for k in range(0, tl.cdiv(num_tasks, num_programs)):
            idx = k * num_programs + tl.where(k % 2 == 0, pid, num_programs - 1 - pid)
            if idx < num_tasks:
                task = tl.load(order_ptr + idx)
                _decode_task(task // (num_kv_heads * NUM_SPLITS), (task // NUM_SPLITS) % num_kv_heads,
                             task % NUM_SPLITS, q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, heads_ptr,
                             seq_lens_ptr, table_ptr, mask_ptr, stride_q, stride_o, stride_k0, stride_k1, stride_v0,
                             stride_v1, stride_table, stride_mb, stride_mh, stride_ms, num_kv_heads, window, scaling,
                             GROUP, PAGE, NUM_SPLITS, BLOCK_N, BLOCK_G, BLOCK_DK, BLOCK_DV, PAGED, HAS_MASK,
                             MASK_BOOL, DOT_PREC, UPCAST)
    else:
        _decode_task(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, k_ptr, v_ptr, out_ptr,
                     part_o_ptr, part_lse_ptr, heads_ptr, seq_lens_ptr, table_ptr, mask_ptr, stride_q, stride_o,
                     stride_k0, stride_k1, stride_v0, stride_v1, stride_table, stride_mb, stride_mh, stride_ms,
                     num_kv_heads, window, scaling, GROUP, PAGE, NUM_SPLITS, BLOCK_N, BLOCK_G, BLOCK_DK, BLOCK_DV,
                     PAGED, HAS_MASK, MASK_BOOL, DOT_PREC, UPCAST)


@triton.jit
def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, heads_ptr, stride_o, num_kv_heads, GROUP: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = h // GROUP
    off_v = tl.load(heads_ptr + 2 * num_kv_heads + g)
    dv = tl.load(heads_ptr + 3 * num_kv_heads + g)
    splits = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_DV)
    slot = (r.to(tl.int64) * num_kv_heads * GROUP + h) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + slot, mask=splits < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)  # empty splits weigh nothing
    o = tl.load(part_o_ptr + slot[:, None] * BLOCK_DV + cols[None, :], mask=(splits < NUM_SPLITS)[:, None],
                other=0.0)
    den = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    o_at = out_ptr + r.to(tl.int64) * stride_o + GROUP * off_v + (h % GROUP) * dv + cols
    tl.store(o_at, o.to(out_ptr.dtype.element_ty), mask=cols < dv)


@functools.lru_cache(maxsize=16)
def _programs(device: str) -> int:
    """Programs that keep the device busy: PROGRAMS_PER_SM per SM (a CPU, under the interpreter: 16)."""
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    return PROGRAMS_PER_SM * sms


def default_splits(max_context: int, tasks: int = 1, programs: int = 512,
                   keys_per_split: int = KEYS_PER_SPLIT) -> int:
    """Splits per sequence: only as many as it takes for `tasks` (sequences × KV heads) to fill `programs`,
    each split at least keys_per_split keys long. A large batch needs none, which also keeps the float32
    partial results (sequences × heads × splits × width) small."""
    by_length = triton.cdiv(int(max_context), keys_per_split)
    by_occupancy = triton.cdiv(programs, max(1, tasks))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def _task_order(seq_lens: torch.Tensor, heads: torch.Tensor, window: int, num_splits: int) -> torch.Tensor:
    """Task ids ((request·G + head)·num_splits + split) by falling cost, built on the device (no host sync):
    a task's cost is its keys × (d_k + d_v), the bytes it reads. Mirrors _decode_task's chunking."""
    end = seq_lens.long()
    n = end - (end - window).clamp(min=0) if window > 0 else end
    chunk = (n + num_splits - 1) // num_splits
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    first = torch.arange(num_splits, device=end.device) * chunk[:, None]  # [R, S]
    keys = (n[:, None] - first).clamp(min=0).minimum(chunk[:, None])
    width = (heads[1] + heads[3]).long()  # [G]
    cost = keys[:, None, :] * width[None, :, None]  # [R, G, S]
    return torch.argsort(cost.flatten(), descending=True).to(torch.int32)


def _launch(q, k, v, out, seq_lens, table, page, d_k, d_v, group, scaling, window, num_splits, balanced,
            num_programs, mask=None) -> torch.Tensor:
    """q [R, Σ_h d_k], out [R, Σ_h d_v]; k / v addressed as major·stride0 + minor·stride1 + column, where
    (major, minor) is (request, position), or (block, position in block) through `table` when one is given.
    `mask`: mask_args' (tensor, strides over request / head / query / key, boolean?) or None."""
    mask_t, (smb, smh, _, sms), mask_bool = mask or (seq_lens, (0, 0, 0, 0), True)  # seq_lens: never read
    paged = table is not None
    if not paged:
        table = seq_lens  # never read
    r_count, g_count = q.shape[0], len(d_k)
    heads = head_table(d_k, d_v, q.device)
    block_dv = tile(max(d_v))
    if num_splits > 1:
        part_o = torch.empty(r_count, g_count * group, num_splits, block_dv, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(r_count, g_count * group, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused: the single split writes the output itself
    num_tasks = r_count * g_count * num_splits
    if balanced:
        order = _task_order(seq_lens, heads, window, num_splits)
        if num_programs is None:
            num_programs = _programs(str(q.device))
        num_programs = max(1, min(int(num_programs), num_tasks))
        grid = (num_programs,)
    else:
        order, num_programs = seq_lens, 1  # order unused
        grid = (r_count, g_count, num_splits)
    _decode_kernel[grid](
        q, k, v, out, part_o, part_lse, heads, seq_lens, table, order, mask_t, q.stride(0), out.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), table.stride(0), smb, smh, sms, g_count, num_tasks,
        num_programs, window, scaling, GROUP=group, PAGE=page, NUM_SPLITS=num_splits, BLOCK_N=BLOCK_N,
        BLOCK_G=tile(group), BLOCK_DK=tile(max(d_k)), BLOCK_DV=block_dv, PAGED=paged, BALANCED=balanced,
        HAS_MASK=mask is not None, MASK_BOOL=mask_bool, **dot_options(_decode_kernel, q.dtype))
    if num_splits > 1:
        _combine_kernel[(r_count, g_count * group)](
            part_o, part_lse, out, heads, out.stride(0), g_count, GROUP=group, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_DV=block_dv)
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k, d_v, group: int, *, scaling: float,
                     seq_lens: torch.Tensor | None = None, sliding_window: int | None = None,
                     num_splits: int | None = None, balanced: bool = False, num_programs: int | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, 1, Σ_h d_k], k [B, S, Σd_k], v [B, S, Σd_v] (a DynamicCache's layer) -> [B, 1, Σ_h d_v].
    The query is the last token: sequence b attends to its first seq_lens[b] keys (default S), the last
    `sliding_window` of them if given. num_splits: context splits per sequence (default from S).

    `mask` (as transformers passes one; reference_attention's semantics) replaces seq_lens and the window:
    bool [B|1, H|1, 1, ≥S] (True = attend) or float (added to the scores), only its first S key columns read
    (mask_problem lists what is taken). A query head with no key to attend to gives 0, as torch's SDPA."""
    check_query(q, d_k, d_v, group)
    b, s = k.shape[0], k.shape[1]
    if mask is not None:
        if seq_lens is not None or sliding_window is not None:
            raise ValueError("pass a mask or seq_lens / sliding_window, not both: the mask alone decides")
        mask = mask_args(mask, b, group * len(d_k), 1, s, q.device)
    if seq_lens is None:
        seq_lens = torch.full((b,), s, dtype=torch.int32, device=q.device)
    if num_splits is None:
        num_splits = default_splits(s if sliding_window is None else min(s, sliding_window), b * len(d_k),
                                    _programs(str(q.device)))
    out = q.new_empty(b, group * sum(d_v))
    _launch(unit_columns(q.reshape(b, -1)), unit_columns(k), unit_columns(v), out, seq_lens, None, 1, d_k, d_v,
            group, scaling, sliding_window or 0, num_splits, balanced, num_programs, mask)
    return out[:, None]


def paged_decode_attention(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, d_k, d_v, group: int, *, scaling: float,
                           sliding_window: int | None = None, num_splits: int | None = None,
                           max_seq_len: int | None = None, balanced: bool = False, num_programs: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """query [R, Σ_h d_k] (one token per request, the last of its sequence) -> [R, Σ_h d_v], over the paged
    cache kv [num_blocks, (1,) block_size, Σd_k + Σd_v] (kvfold_runtime.kernels.paged). max_seq_len bounds
    seq_lens (default: the block table's capacity) and sets the default num_splits without a host sync."""
    check_query(query, d_k, d_v, group)
    check_paged(query, kv, out)
    blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])  # [num_blocks, block_size, C], a view
    page = blocks.shape[1]
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * page
    if num_splits is None:
        context = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
        num_splits = default_splits(context, query.shape[0] * len(d_k), _programs(str(query.device)))
    if out is None:
        out = query.new_empty(query.shape[0], group * sum(d_v))
    values = blocks[..., sum(d_k):]  # same rows, addressed from the first value column
    _launch(unit_columns(query), blocks, values, out, seq_lens, block_table, page, d_k, d_v, group, scaling,
            sliding_window or 0, num_splits, balanced, num_programs)
    return out
