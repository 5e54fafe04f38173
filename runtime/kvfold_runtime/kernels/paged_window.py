"""Paged attention of a windowed bits layer (issue 51): band codes in the paged cache, whole rows in a ring.

A windowed bits export reads cached token j at the model's dtype where j < sinks or i − j < window, for a query at
position i, and from its band codes everywhere else (kernels.torch_window). Served from a paged cache, every token's
codes sit in the layer's pages as for any bits layer (kernels.paged), and each request also holds one *ring* of
sinks + window whole rows [k | v] (the packed widths of kvfold_runtime.format, in the model's dtype):

  ring      [ring_blocks, sinks + window, ≥ Σd_k + Σd_v] (any strides: vLLM's is a view of its block);
            a request's ring is one block (`ring_blocks[r]`)
  slot      position p < sinks at slot p, else at sinks + (p − sinks) mod window

so the ring keeps the sinks and the last `window` positions written, which is everything a query of the next step
reads whole. A step writes its tokens' codes first (the caller), then attends — the step's own whole rows come from
its keys and values, older ones from the ring — and only then writes its rows into the ring, so a chunk longer than
the window cannot overwrite rows its first queries still read.

Plain torch, any device. The step's one-token requests run together (kernels.paged's batched decode over their
blocks, the ring's rows put in place of the decoded ones); each prefill or chunk on its own: its rows decoded, its
whole rows gathered, and one causal attention over the codes merged with the whole rows' part
(kernels.window_prefill, through the caller's fast causal kernel where it gives one). On a CPU, vLLM's backend runs a
step of decodes only in C instead (cpu_step.DecodeLayer with the rings: the step's row written to its ring first, as
no decode reads its own slot's previous row whole); this path serves the other steps and devices.
"""

from __future__ import annotations

import torch

from kvfold_runtime.kernels.paged import BandPages, BandRows, StepPlan, _gather, plan_step
from kvfold_runtime.kernels.torch_decode import packed_decode
from kvfold_runtime.kernels.window_prefill import LogitAttention, whole_positions, windowed_prefill

__all__ = ["ring_slots", "windowed_paged_attention", "write_ring"]

def ring_slots(positions: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """The ring slot of each position (see the module docstring)."""
    if window == 0:
        return positions
    return torch.where(positions < sinks, positions, sinks + (positions - sinks).remainder(window))


def _positions(seq_lens: list[int], starts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token of the step: its request and its absolute position (its request's last tokens)."""
    request, position = [], []
    for r, s in enumerate(seq_lens):
        t = starts[r + 1] - starts[r]
        request.append(torch.full((t,), r, dtype=torch.long))
        position.append(torch.arange(s - t, s))
    return torch.cat(request).to(device), torch.cat(position).to(device)


def write_ring(ring: torch.Tensor, ring_blocks: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, *, sinks: int, window: int) -> None:
    """Store the step's whole rows k [T, Σd_k], v [T, Σd_v] (requests as vLLM describes them: query_start_loc
    [R + 1], seq_lens [R]) in their requests' rings `ring` [blocks, sinks + window, ≥ Σd_k + Σd_v] (any strides):
    the sinks, and each request's last `window` positions."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    n = starts[-1]
    if n == 0:
        return
    request, position = _positions(lens, starts, ring.device)
    last = seq_lens.to(ring.device).long()[request]
    keep = (position < sinks) | (position >= last - window)
    block = ring_blocks.to(ring.device).long()[request][keep]
    rows = torch.cat([k[:n], v[:n]], -1)[keep.to(k.device)]
    ring[block, ring_slots(position[keep], sinks, window), :rows.shape[-1]] = rows.to(ring.device, ring.dtype)


def windowed_paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor,
                             ring: torch.Tensor, ring_blocks: torch.Tensor, block_table: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, codec: BandRows, *,
                             scaling: float, sinks: int, window: int, out: torch.Tensor,
                             prefill: LogitAttention | None = None) -> torch.Tensor:
    """query [T, Σ_h d_k(g(h))] -> out [T, Σ_h d_v(g(h))]: each request's queries over its cached tokens, the
    step's codes already written to `kv` (kernels.paged's layout, rows written by `codec`), its keys `key`
    [T, Σd_k] and values `value` [T, Σd_v] not yet in the ring (written by write_ring after this call).
    `prefill`: a faster causal attention with an extra key (window_prefill.LogitAttention), SDPA where None."""
    if isinstance(codec, BandPages):  # the GPU page layout: read as rows (a copy of the cache)
        kv, codec = codec.as_rows(kv), BandRows(codec.dims)
    dims = codec.dims
    d_k, d_v = list(dims.d_k), list(dims.d_v)
    split = sum(d_k)
    blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    plan = plan_step(block_table, seq_lens.cpu(), query_start_loc.cpu(), blocks.shape[1])
    if plan.decode_rows is not None:
        decoding = torch.tensor([r for r in range(len(lens)) if starts[r + 1] - starts[r] == 1])
        _decodes(query, key, value, blocks, ring, ring_blocks.cpu()[decoding], seq_lens.cpu()[decoding].long() - 1,
                 plan, codec, scaling=scaling, sinks=sinks, window=window, out=out)
    for r, s in enumerate(lens):
        first, t = starts[r], starts[r + 1] - starts[r]
        if t <= 1:  # decodes: above
            continue
        old = s - t  # tokens cached before this step
        k, v = codec.decode(_gather(blocks, block_table[r], 0, s), query.dtype)  # [s, Σd_k], [s, Σd_v]
        positions = whole_positions(s, t, sinks, window).to(kv.device)  # the whole rows the step reads
        from_ring = positions < old
        exact = torch.empty(positions.shape[0], split + sum(d_v), dtype=ring.dtype, device=ring.device)
        held = ring[int(ring_blocks[r])]  # [capacity, ≥ Σd_k + Σd_v]
        exact[from_ring] = held[ring_slots(positions[from_ring], sinks, window), :exact.shape[-1]]
        mine = torch.cat([key[first:first + t], value[first:first + t]], -1).to(ring.dtype)
        exact[~from_ring] = mine[positions[~from_ring] - old]
        o = windowed_prefill(query[first:first + t], k, v, exact[:, :split], exact[:, split:], d_k, d_v, dims.group,
                             scaling=scaling, sinks=sinks, window=window, causal=prefill)
        out[first:first + t] = o.to(out.dtype)
    return out


def _decodes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: torch.Tensor, ring: torch.Tensor,
             ring_blocks: torch.Tensor, last: torch.Tensor, plan: StepPlan, codec: BandRows, *, scaling: float,
             sinks: int, window: int, out: torch.Tensor) -> None:
    """The step's one-token requests together (paged_attention's decode over plan_step's blocks; `ring_blocks` and
    `last`, each one's ring and its query's position): their rows decoded, the ring's rows put in place of the sinks
    and of the window's older positions, the step's own row in place of the newest (its ring slot still holds the
    position `window` before it, which this query reads from its codes)."""
    d_k, d_v = list(codec.dims.d_k), list(codec.dims.d_v)
    split = sum(d_k)
    n, count = plan.decode_blocks.shape
    rows = blocks.index_select(0, plan.decode_blocks.view(-1)).view(n, count * blocks.shape[1], -1)
    rows.view(-1, rows.shape[-1])[plan.decode_unseen] = 0  # unwritten rows (NaN bytes?): 0 · NaN is NaN
    k, v = codec.decode(rows, query.dtype)  # [N, B·block_size, Σd_k]: row p is position p (no sliding window)
    last = last.to(k.device)
    slot = torch.arange(sinks + window, device=k.device)[None, :]  # [1, capacity]
    position = slot.expand(n, -1)
    if window:  # a window slot holds the latest position p ≤ last with p ≡ slot (mod window) (ring_slots)
        position = torch.where(slot < sinks, slot, last[:, None] - (last[:, None] - slot).remainder(window))
    readable = (position < last[:, None]) & ((slot < sinks) | (position >= sinks))
    held = ring[ring_blocks.to(ring.device).long()][..., :split + sum(d_v)].to(query.dtype)  # [N, capacity, ·]
    at, where = readable.nonzero().unbind(1)
    k[at, position[at, where]] = held[at, where, :split]
    v[at, position[at, where]] = held[at, where, split:]
    rows = plan.decode_rows
    newest = (last < sinks) | (window > 0)  # the query's own token: whole inside the window or the sinks
    k[newest.nonzero()[:, 0], last[newest]] = key[rows[newest]].to(k.dtype)
    v[newest.nonzero()[:, 0], last[newest]] = value[rows[newest]].to(v.dtype)
    out[rows] = packed_decode(query[rows], k, v, plan.decode_valid, d_k, d_v, codec.dims.group,
                              scaling=scaling).to(out.dtype)
