"""The decode steps `kvfold-bench kernels` times as vLLM's backend runs them on a GPU for a bits layer in the page
layout: a plain layer's (paged_step) and a windowed layer's (windowed_step). Each returns a function running one
step, host work and every launch included, over a cache kernels._pages made, and returning its output buffer;
`graphed` turns such a step into the replay of a CUDA graph that captured it, as vLLM's full CUDA-graph mode runs a
batch of decodes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvfold_bench.kernels import LayerWidths

PAGE = 16  # vLLM's KV block size on CUDA: a page of the GPU layout


def paged_step(layer: LayerWidths, q, kv, table, lens, starts, s: int, scaling: float, gen):
    """A plain bits layer's decode step as vLLM's backend runs it on a GPU: the new key and value encoded into their
    page slots, then the attention: what a decode pays per layer, host work and every launch included."""
    from kvfold_runtime.kernels import write_paged
    from kvfold_runtime.kernels.dispatch import paged
    from kvfold_runtime.kernels.paged import BandPages

    b, d = q.shape[0], layer.dims
    key = torch.randn(b, sum(d.d_k), generator=gen, device=q.device).to(q.dtype)
    value = torch.randn(b, sum(d.d_v), generator=gen, device=q.device).to(q.dtype)
    last = lens.long() - 1  # each request's newest position: its slot in its last block
    slots = table.long().gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE
    out, codec = torch.empty(b, d.out_width, dtype=q.dtype, device=q.device), BandPages(d, PAGE)

    def step():
        write_paged(kv, slots, key, value, codec=codec)
        return paged(q, kv, table, lens, starts, list(d.d_k), list(d.d_v), d.group, scaling=scaling, out=out,
                     codec=codec, max_query_len=1, max_seq_len=s)
    return step


def windowed_step(layer: LayerWidths, q, kv, table, lens, starts, s: int, scaling: float, gen, sinks: int = 16,
                     window: int = 64):
    """A windowed bits layer's decode step as vLLM's backend runs it on a GPU, the windowed export's defaults of 16
    sinks and a 64-token window: the new token's codes written to its page slot, the attention (kernels.paged_window:
    the page kernel over the codes past the sinks and before the window, then the sinks and window from each
    request's ring and the merge), and the token's whole row written to its ring; host work and every launch."""
    from kvfold_runtime.kernels import write_paged
    from kvfold_runtime.kernels.paged import BandPages
    from kvfold_runtime.kernels.paged_window import windowed_paged_attention, write_ring

    b, d = q.shape[0], layer.dims
    widths = sum(d.d_k) + sum(d.d_v)
    ring = torch.randn(b, sinks + window, widths, generator=gen, device=q.device).to(q.dtype)
    key = torch.randn(b, sum(d.d_k), generator=gen, device=q.device).to(q.dtype)
    value = torch.randn(b, sum(d.d_v), generator=gen, device=q.device).to(q.dtype)
    last = lens.long() - 1
    slots = table.long().gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE
    out = torch.empty(b, d.out_width, dtype=q.dtype, device=q.device)
    codec, blocks = BandPages(d, PAGE), torch.arange(b, dtype=torch.int32, device=q.device)

    def step():
        write_paged(kv, slots, key, value, codec=codec)
        windowed_paged_attention(q, key, value, kv, ring, blocks, table, lens, starts, codec, scaling=scaling,
                                 sinks=sinks, window=window, out=out, max_query_len=1, max_seq_len=s)
        write_ring(ring, blocks, lens, starts, key, value, sinks=sinks, window=window, max_query_len=1)
        return out
    return step


def graphed(step):
    """The replay of a CUDA graph that captured `step` (run twice first on a side stream: kernels compiled, tables
    built, as vLLM warms up before it captures). Raises where the step cannot be captured (a read back to the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay
