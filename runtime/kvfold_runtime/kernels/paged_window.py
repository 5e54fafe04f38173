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
whole rows' part is a small attention over the ring's readable rows and the query's own, merged with the codes'
partial results by log-sum-exp (merge_parts): the codes are read once, in place, never decoded into a copy.
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

from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels.dispatch import paged_kernels_for
from kvfold_runtime.kernels.paged import BandPages, BandRows, StepPlan, _gather, plan_step
from kvfold_runtime.kernels.torch_decode import packed_decode
from kvfold_runtime.kernels.window_prefill import LogitAttention, whole_positions, windowed_prefill

__all__ = ["merge_parts", "ring_slots", "windowed_paged_attention", "write_ring"]

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
    dims = codec.dims
    d_k, d_v = list(dims.d_k), list(dims.d_v)
    split = sum(d_k)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decoding = [r for r in range(len(lens)) if starts[r + 1] - starts[r] == 1]
    pages = isinstance(codec, BandPages) and paged_kernels_for(query, codec) == "triton"
    if decoding and pages:
        _page_decodes(query, key, value, kv, ring, ring_blocks, block_table, seq_lens, torch.tensor(decoding),
                      torch.tensor([starts[r] for r in decoding]), max(lens[r] for r in decoding), codec,
                      scaling=scaling, sinks=sinks, window=window, out=out)
    elif decoding:
        rows_kv, rows_codec = (codec.as_rows(kv), BandRows(dims)) if isinstance(codec, BandPages) else (kv, codec)
        blocks = rows_kv.reshape(rows_kv.shape[0], -1, rows_kv.shape[-1])
        plan = plan_step(block_table, seq_lens.cpu(), query_start_loc.cpu(), blocks.shape[1])
        decoding = torch.tensor(decoding)
        _decodes(query, key, value, blocks, ring, ring_blocks.cpu()[decoding], seq_lens.cpu()[decoding].long() - 1,
                 plan, rows_codec, scaling=scaling, sinks=sinks, window=window, out=out)
    for r, s in enumerate(lens):
        first, t = starts[r], starts[r + 1] - starts[r]
        if t <= 1:  # decodes: above
            continue
        old = s - t  # tokens cached before this step
        k, v = BandRows(dims).decode(_request_rows(kv, block_table[r], s, codec), query.dtype)  # [s, Σd_k], [s, Σd_v]
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


def _page_decodes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor,
                  ring_blocks: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, decoding: torch.Tensor,
                  rows: torch.Tensor, longest: int, codec: BandPages, *, scaling: float, sinks: int, window: int,
                  out: torch.Tensor) -> None:
    """The step's one-token requests (`decoding`, their query rows `rows`, the longest `longest` tokens) over the
    GPU page layout: their codes part by the page kernel, their whole rows' part (_ring_part), merged."""
    from kvfold_runtime.kernels import triton_pages  # imported only where Triton runs

    dev, n = query.device, decoding.shape[0]
    rows = rows.to(dev)
    lens = seq_lens.to(dev)[decoding.to(dev)]
    q = query[rows]
    o, lse = triton_pages.history_parts(
        q, kv, block_table[decoding.to(block_table.device)], lens, torch.arange(n + 1, dtype=lens.dtype, device=dev),
        codec.dims, scaling=scaling, sinks=sinks, window=window, max_query_len=1, max_seq_len=longest)
    o[:, :, -1], lse[:, :, -1] = _ring_part(q, key[rows], value[rows], ring, ring_blocks[decoding.to(
        ring_blocks.device)], lens.long() - 1, codec.dims, scaling=scaling, sinks=sinks, window=window,
        width=o.shape[-1])
    out[rows] = merge_parts(o, lse, codec.dims).to(out.dtype)


def _ring_part(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, ring: torch.Tensor,
               ring_blocks: torch.Tensor, last: torch.Tensor, dims: LayerDims, *, scaling: float, sinks: int,
               window: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode's attention over its whole rows alone (query at position `last`, its row k_own / v_own not yet
    in its ring): the ring's sinks before it and its window's older positions (the slot of `last` still holds
    position last − window, a code), and its own row where it is whole -> (o [N, H, width] float32 normalised,
    lse [N, H]; −inf where it saw no row)."""
    n, f32, group = q.shape[0], torch.float32, dims.group
    d_k, d_v = list(dims.d_k), list(dims.d_v)
    split = sum(d_k)
    readable = _ring_positions(last, sinks, window)[1]
    own = (last < sinks) | (window > 0)  # the query's own row: whole inside the sinks or the window
    held = ring[ring_blocks.to(ring.device).long()][..., :split + sum(d_v)].to(q.device, f32)  # [N, capacity, ·]
    seen = torch.cat([readable, own[:, None]], 1)[:, None, :]  # [N, 1, capacity + 1]
    keys = torch.cat([held, torch.cat([k_own, v_own], -1).to(f32)[:, None]], 1)  # [N, capacity + 1, ·]
    keys = torch.where(seen[:, 0, :, None], keys, 0.0)  # an unwritten slot may hold NaN: 0 · NaN is NaN
    # every head at once, padded to the widest (zero dims add nothing to a score or a value): on a GPU each torch
    # call is a launch, and a loop over heads made the step's host time grow with the head count
    qh = _by_head(q.to(f32), d_k, group)  # [N, G, group, d_k]
    kh = _by_head(keys[..., :split], d_k)[..., 0, :].transpose(1, 2)  # [N, G, capacity + 1, d_k]
    vh = _by_head(keys[..., split:], d_v)[..., 0, :].transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2) * scaling).masked_fill(~seen[:, :, None], float("-inf"))
    lse = scores.logsumexp(-1)  # [N, G, group]
    weights = torch.nan_to_num(scores.softmax(-1))  # a query that saw no row: weights 0, not NaN
    o = torch.nn.functional.pad(weights @ vh, (0, width - max(d_v)))
    return o.view(n, -1, width), lse.view(n, -1)


def _by_head(x: torch.Tensor, widths: list[int], rows: int = 1) -> torch.Tensor:
    """[..., Σ rows·w] packed heads (each rows × w) -> [..., G, rows, widest], each head zero-padded to the widest
    (a view when every head is as wide)."""
    widest = max(widths)
    if all(w == widest for w in widths):
        return x.unflatten(-1, (len(widths), rows, widest))
    heads = x.split([rows * w for w in widths], -1)
    return torch.stack([torch.nn.functional.pad(h.unflatten(-1, (rows, w)), (0, widest - w))
                        for h, w in zip(heads, widths, strict=True)], -3)


def merge_parts(o: torch.Tensor, lse: torch.Tensor, dims: LayerDims) -> torch.Tensor:
    """Partial attentions o [T, H, P, D] (each normalised over its own keys, dims in order) with their log-sum-exps
    lse [T, H, P] (−inf: no key) -> the attention over all their keys, packed [T, Σ_h d_v(g(h))] float32."""
    top = lse.amax(-1, keepdim=True)
    weights = torch.where(lse > float("-inf"), (lse - top.clamp_min(torch.finfo(lse.dtype).min)).exp(), 0.0)
    merged = (weights[..., None] * o).sum(2) / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(o.dtype).tiny)
    g = dims.group
    if all(dv == merged.shape[-1] for dv in dims.d_v):  # every head as wide as the parts: already packed
        return merged.flatten(1)
    return torch.cat([merged[:, h * g:(h + 1) * g, :dv].flatten(1) for h, dv in enumerate(dims.d_v)], -1)
