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

The step's one-token requests run together. In the GPU page layout (BandPages, where Triton runs) they take the
page kernel for their codes part alone — positions [sinks, i − window] (triton_pages.history_parts) — and their
whole rows' part — the ring's readable rows and the query's own — is attended and merged with the codes' partial
results by log-sum-exp in one more launch (triton_ring): the codes are read once, in place, never decoded into a
copy. Where vLLM says on the host that the step's first requests decode (max_query_len 1, or a StepSplit), nothing
of the step is read back from the device: a decode step is two launches after the codes' write, and the ring's.
Elsewhere (plain torch, any device) kernels.paged's batched decode reads their blocks and puts the ring's rows in
place of the decoded ones. Each prefill or chunk runs on its own: its rows decoded (its own pages turned back into
rows first in the page layout), its whole rows gathered, and one causal attention over the codes merged with the
whole rows' part (kernels.window_prefill, through the caller's fast causal kernel where it gives one). On a CPU,
vLLM's backend runs a step of decodes only in C instead (cpu_step.DecodeLayer with the rings: the step's row written
to its ring first, as no decode reads its own slot's previous row whole); this path serves the other steps and
devices.
"""

from __future__ import annotations

import torch

from kvfold_runtime.kernels.dispatch import StepSplit, paged_kernels_for
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
               k: torch.Tensor, v: torch.Tensor, *, sinks: int, window: int, max_query_len: int | None = None) -> None:
    """Store the step's whole rows k [T, Σd_k], v [T, Σd_v] (requests as vLLM describes them: query_start_loc
    [R + 1], seq_lens [R]) in their requests' rings `ring` [blocks, sinks + window, ≥ Σd_k + Σd_v] (any strides):
    the sinks, and each request's last `window` positions. `max_query_len` 1 (a step of decodes, as vLLM knows
    without a host sync): each request's one row goes to its slot without reading the step's lengths back."""
    if max_query_len == 1 and sinks + window > 0:  # one row a request, at its last position
        n = seq_lens.shape[0]
        position = seq_lens.to(ring.device).long() - 1
        block = ring_blocks.to(ring.device).long()
        slot = ring_slots(position, sinks, window).clamp(max=sinks + window - 1)
        rows = torch.cat([k[:n], v[:n]], -1).to(ring.device, ring.dtype)
        if window == 0:  # only a sink's row is kept: the others write back what their slot holds (no host sync)
            rows = torch.where((position < sinks)[:, None], rows, ring[block, slot, :rows.shape[-1]])
        ring[block, slot, :rows.shape[-1]] = rows
        return
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
                             prefill: LogitAttention | None = None, max_query_len: int | None = None,
                             max_seq_len: int | None = None, split: StepSplit | None = None) -> torch.Tensor:
    """query [T, Σ_h d_k(g(h))] -> out [T, Σ_h d_v(g(h))]: each request's queries over its cached tokens, the
    step's codes already written to `kv` (kernels.paged's layout, rows written by `codec`), its keys `key`
    [T, Σd_k] and values `value` [T, Σd_v] not yet in the ring (written by write_ring after this call).
    `prefill`: a faster causal attention with an extra key (window_prefill.LogitAttention), SDPA where None.
    What vLLM knows on the host, where given, spares the GPU path reading the step back: `max_query_len` 1 (a step
    of decodes) or `split` (decodes first, then the prefills: dispatch.StepSplit), and `max_seq_len`."""
    dims = codec.dims
    d_k, d_v = list(dims.d_k), list(dims.d_v)
    split_at = sum(d_k)
    pages = isinstance(codec, BandPages) and paged_kernels_for(query, codec) == "triton"
    if pages and (max_query_len == 1 or split is not None):  # decodes first: requests and query rows [0, n)
        n = seq_lens.shape[0] if split is None else split.decodes
        longest = max_seq_len if max_seq_len is not None else block_table.shape[1] * codec.layout.page
        if n:
            _page_decodes(query[:n], key[:n], value[:n], kv, ring, ring_blocks[:n], block_table[:n], seq_lens[:n],
                          query_start_loc[:n + 1], longest, codec, scaling=scaling, sinks=sinks, window=window,
                          out=out[:n])
        prefills = () if split is None else split.prefills
    else:  # the step read back from the device
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        decoding = [r for r in range(len(lens)) if starts[r + 1] - starts[r] == 1]
        prefills = tuple((r, starts[r], starts[r + 1] - starts[r], s) for r, s in enumerate(lens)
                         if starts[r + 1] - starts[r] > 1)
        if decoding and pages:
            picked, rows = torch.tensor(decoding), torch.tensor([starts[r] for r in decoding], device=query.device)
            o = out.new_empty(len(decoding), out.shape[-1])
            _page_decodes(query[rows], key[rows.to(key.device)], value[rows.to(value.device)], kv, ring,
                          ring_blocks[picked.to(ring_blocks.device)], block_table[picked.to(block_table.device)],
                          seq_lens[picked.to(seq_lens.device)], torch.arange(len(decoding) + 1, dtype=torch.int32),
                          max(lens[r] for r in decoding), codec, scaling=scaling, sinks=sinks, window=window, out=o)
            out[rows] = o
        elif decoding:
            rows_kv, rows_codec = (codec.as_rows(kv), BandRows(dims)) if isinstance(codec, BandPages) else (kv, codec)
            blocks = rows_kv.reshape(rows_kv.shape[0], -1, rows_kv.shape[-1])
            plan = plan_step(block_table, seq_lens.cpu(), query_start_loc.cpu(), blocks.shape[1])
            decoding = torch.tensor(decoding)
            _decodes(query, key, value, blocks, ring, ring_blocks.cpu()[decoding],
                     seq_lens.cpu()[decoding].long() - 1, plan, rows_codec, scaling=scaling, sinks=sinks,
                     window=window, out=out)
    for r, first, t, s in prefills:
        old = s - t  # tokens cached before this step
        k, v = BandRows(dims).decode(_request_rows(kv, block_table[r], s, codec), query.dtype)  # [s, Σd_k], [s, Σd_v]
        positions = whole_positions(s, t, sinks, window).to(kv.device)  # the whole rows the step reads
        from_ring = positions < old
        exact = torch.empty(positions.shape[0], split_at + sum(d_v), dtype=ring.dtype, device=ring.device)
        held = ring[int(ring_blocks[r])]  # [capacity, ≥ Σd_k + Σd_v]
        exact[from_ring] = held[ring_slots(positions[from_ring], sinks, window), :exact.shape[-1]]
        mine = torch.cat([key[first:first + t], value[first:first + t]], -1).to(ring.dtype)
        exact[~from_ring] = mine[positions[~from_ring] - old]
        o = windowed_prefill(query[first:first + t], k, v, exact[:, :split_at], exact[:, split_at:], d_k, d_v,
                             dims.group, scaling=scaling, sinks=sinks, window=window, causal=prefill)
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
    position, readable = _ring_positions(last, sinks, window)
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


def _ring_positions(last: torch.Tensor, sinks: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For decodes at positions `last` [N]: the position each ring slot holds [N, capacity], and whether the query
    reads it from the ring (a sink before it, or an older position of its window past the sinks)."""
    slot = torch.arange(sinks + window, device=last.device)[None, :]  # [1, capacity]
    position = slot.expand(last.shape[0], -1)
    if window:  # a window slot holds the latest position p ≤ last with p ≡ slot (mod window) (ring_slots)
        position = torch.where(slot < sinks, slot, last[:, None] - (last[:, None] - slot).remainder(window))
    return position, (position < last[:, None]) & ((slot < sinks) | (position >= sinks))


def _request_rows(kv: torch.Tensor, table_row: torch.Tensor, s: int, codec: BandRows) -> torch.Tensor:
    """The rows [s, C] of one request's first s positions: its own blocks only (pages turned back into rows in the
    page layout)."""
    if isinstance(codec, BandPages):
        return codec.request_rows(kv, table_row, s).reshape(-1, codec.layout.row_bytes)[:s]
    return _gather(kv.reshape(kv.shape[0], -1, kv.shape[-1]), table_row, 0, s)


def _page_decodes(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor,
                  ring_blocks: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, longest: int, codec: BandPages, *, scaling: float, sinks: int,
                  window: int, out: torch.Tensor) -> None:
    """N one-token requests (their queries q [N, ·], own keys and values, rings, block tables and lengths, query
    rows 0..N in query_start_loc, the longest `longest` tokens) over the GPU page layout -> out [N, ·]: their codes
    part by the page kernel, then their whole rows' part and the merge in one more launch (triton_ring)."""
    from kvfold_runtime.kernels import triton_pages, triton_ring  # imported only where Triton runs

    dev = q.device
    lens = seq_lens.to(dev)
    o, lse = triton_pages.history_parts(q, kv, block_table.to(dev), lens, query_start_loc.to(dev), codec.dims,
                                        scaling=scaling, sinks=sinks, window=window, max_query_len=1,
                                        max_seq_len=longest)
    triton_ring.ring_merge(q, k_own, v_own, ring, ring_blocks.to(dev), lens, o, lse, codec.dims, scaling=scaling,
                           sinks=sinks, window=window, out=out)
