"""A windowed bits layer's decode, finished in one Triton launch: the whole rows' part and the merge.

A windowed layer's decode reads its codes part from the pages (triton_pages.history_parts: partial results over
context splits) and its sinks and window whole, from the request's ring and from the step's own key and value
(kernels.paged_window). This kernel does everything after the page kernel: for each (decode, query head) it attends
over the readable ring rows and its own row, then merges that part with the codes' splits by log-sum-exp and writes
the head's output. In torch the same work was ~45 small launches and their host time, a fixed ~1.3–2.0 ms a layer's
step on an H100 whatever the batch (docs/kernels-h100.json, `kvfold_triton_pages_window_us`), several times the page
kernel itself; here it is one launch whose reads are the ring rows (sinks + window + 1 per head) and the partials.

The ring holds whole rows [k | v] in the model's dtype (paged_window's module docstring: position p < sinks at slot
p, else at sinks + (p − sinks) mod window). For a decode at position `last` the slot of `last` still holds position
last − window, which the query reads from its codes, so it is never read here: the ring is only read, and the
caller's write of the step's rows into it (paged_window.write_ring) follows this launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels.triton_common import head_table, program_head

__all__ = ["ring_merge"]

BLOCK_C = 16  # ring slots a loop step scores (an online softmax over them: few registers at any window)


@triton.jit
def _ring_merge_kernel(q_ptr, k_ptr, v_ptr, ring_ptr, blocks_ptr, lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
                       heads_ptr, stride_q, stride_k, stride_v, stride_o, stride_block, stride_slot, value_col,
                       num_kv_heads, sinks, window, scaling, GROUP: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)  # the decode
    h = tl.program_id(1)  # the query head
    g = h // GROUP
    j = h % GROUP
    off_k, dk, off_v, dv = program_head(heads_ptr, num_kv_heads, g)
    last = tl.load(lens_ptr + n).to(tl.int32) - 1  # the query's position
    block = tl.load(blocks_ptr + n).to(tl.int64)
    kd = tl.arange(0, BLOCK_DK)
    vd = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + n * stride_q + GROUP * off_k + j * dk + kd, mask=kd < dk, other=0.0).to(tl.float32)
    capacity = sinks + window
    period = tl.maximum(window, 1)
    m_i = tl.max(tl.full([BLOCK_C], float("-inf"), tl.float32), 0)  # scalars the loop carries
    l_i = tl.sum(tl.zeros([BLOCK_C], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c0 in range(0, capacity + 1, BLOCK_C):  # the ring's slots, then slot `capacity`: the query's own row
        c = c0 + tl.arange(0, BLOCK_C)
        # conditions as vectors: Triton's interpreter makes a scalar bool & a vector bool an integer, no mask
        windowed = c * 0 + window > 0
        # the position a slot holds: a window slot the latest p ≤ last with p ≡ slot (mod window) (ring_slots)
        back = ((last - c) % period + period) % period
        pos = tl.where((c >= sinks) & windowed, last - back, c)
        ring = (c < capacity) & (pos < last) & ((c < sinks) | (pos >= sinks))
        own = (c == capacity) & ((c * 0 + last < sinks) | windowed)  # own row: whole in the sinks or window
        slot_at = ring_ptr + block * stride_block + c.to(tl.int64)[:, None] * stride_slot
        k = tl.load(slot_at + off_k + kd[None, :], mask=ring[:, None] & (kd < dk)[None, :], other=0.0)
        k = k.to(tl.float32) + tl.load(k_ptr + n * stride_k + off_k + kd[None, :] + 0 * c[:, None],
                                       mask=own[:, None] & (kd < dk)[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * scaling
        s = tl.where(ring | own, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing seen yet: exp gives 0, not NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        v = tl.load(slot_at + value_col + off_v + vd[None, :], mask=ring[:, None] & (vd < dv)[None, :], other=0.0)
        v = v.to(tl.float32) + tl.load(v_ptr + n * stride_v + off_v + vd[None, :] + 0 * c[:, None],
                                       mask=own[:, None] & (vd < dv)[None, :], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    lse_ring = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    o_ring = acc / tl.where(l_i > 0, l_i, 1.0)
    # the codes' splits (history_parts: SPLITS + 1 slots a row, the last left for this part), merged with it
    splits = tl.arange(0, BLOCK_S)
    slot = (n * num_kv_heads * GROUP + h) * (SPLITS + 1) + splits
    lse = tl.load(part_lse_ptr + slot, mask=splits < SPLITS, other=float("-inf"))
    o = tl.load(part_o_ptr + slot[:, None] * BLOCK_D + vd[None, :], mask=(splits < SPLITS)[:, None], other=0.0)
    top = tl.maximum(tl.max(lse, 0), lse_ring)
    top = tl.where(top > float("-inf"), top, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)  # a part that saw no key weighs nothing
    w_ring = tl.where(lse_ring > float("-inf"), tl.exp(lse_ring - top), 0.0)
    den = tl.sum(w, 0) + w_ring
    merged = (tl.sum(w[:, None] * o, 0) + w_ring * o_ring) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + n * stride_o + GROUP * off_v + j * dv + vd, merged.to(out_ptr.dtype.element_ty),
             mask=vd < dv)


def ring_merge(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, ring: torch.Tensor,
               ring_blocks: torch.Tensor, seq_lens: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor,
               dims: LayerDims, *, scaling: float, sinks: int, window: int, out: torch.Tensor) -> torch.Tensor:
    """N decodes: queries q [N, Σ_h d_k(g(h))] at positions seq_lens − 1, their own keys k_own [N, Σd_k] and
    values v_own [N, Σd_v] (not yet in their rings), each one's ring `ring[ring_blocks[n]]` [capacity, ≥ Σd_k + Σd_v]
    (any block and slot strides, rows contiguous), and the codes' partial results of history_parts (part_o
    [N, H, S + 1, D], part_lse [N, H, S + 1]) -> out [N, Σ_h d_v(g(h))] (any row stride), the whole attention."""
    n, heads, parts, width = part_o.shape
    if n == 0:
        return out
    if any(x.stride(-1) != 1 for x in (q, k_own, v_own, ring, out)):
        raise ValueError("ring_merge needs rows with stride 1 along their last dimension")
    _ring_merge_kernel[(n, heads)](
        q, k_own, v_own, ring, ring_blocks, seq_lens, part_o, part_lse, out, head_table(dims.d_k, dims.d_v, q.device),
        q.stride(0), k_own.stride(0), v_own.stride(0), out.stride(0), ring.stride(0), ring.stride(1), sum(dims.d_k),
        dims.num_kv_heads, sinks, window, scaling, GROUP=dims.group, SPLITS=parts - 1,
        BLOCK_S=max(2, triton.next_power_of_2(parts - 1)), BLOCK_C=BLOCK_C,
        BLOCK_DK=max(16, triton.next_power_of_2(max(dims.d_k))), BLOCK_D=width)
    return out
