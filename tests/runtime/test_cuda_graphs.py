"""A bits layer's decode step on the GPU page layout captured in a CUDA graph, as vLLM's FULL cudagraph mode would
capture a batch of decodes: the plain layer's (codes written to their page slots, then the page kernel) and the
windowed layer's (codes written, the page kernel over the codes part, the ring's sinks and window and the merge,
the step's rows written to the rings). Capture fails on any read back to the host; a replay with every request
one token longer, new queries, keys and values copied into the captured buffers, must give what the same step
gives run eagerly. What would let kvfold's vLLM backend declare CUDA-graph support for decodes (not declared yet:
this test has not run on a GPU). On CUDA only."""

import pytest
import torch

from kvfold_bench.kernel_steps import PAGE
from kvfold_bench.kernels import _bits_layers, _pages
from kvfold_runtime.kernels import write_paged
from kvfold_runtime.kernels.dispatch import paged
from kvfold_runtime.kernels.paged import BandPages
from kvfold_runtime.kernels.paged_window import windowed_paged_attention, write_ring

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BATCH, TOKENS, LONGEST = 3, 199, 208  # each request 199 tokens, then 200 at the replay; pages hold 208
SINKS, WINDOW = 16, 64


@pytest.mark.parametrize("windowed", [False, True])
def test_a_decode_step_replays_from_a_cuda_graph(windowed, monkeypatch):
    monkeypatch.setenv("KVFOLD_KERNELS", "triton")
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(3)
    layer = _bits_layers(num_heads=8, num_kv_heads=2, head_dim=64)[1]  # keys 8/5/4, values 6/4 bits
    dims, codec = layer.dims, BandPages(layer.dims, PAGE)
    kv, table, lens, starts = _pages(layer, BATCH, LONGEST, dev, gen)
    lens.fill_(TOKENS)
    q = torch.empty(BATCH, dims.q_width, dtype=torch.bfloat16, device=dev)
    key = torch.empty(BATCH, sum(dims.d_k), dtype=torch.bfloat16, device=dev)
    value = torch.empty(BATCH, sum(dims.d_v), dtype=torch.bfloat16, device=dev)
    slots = torch.empty(BATCH, dtype=torch.long, device=dev)
    ring = torch.randn(BATCH, SINKS + WINDOW, sum(dims.d_k) + sum(dims.d_v), generator=gen, device=dev)
    ring = ring.to(torch.bfloat16)
    blocks = torch.arange(BATCH, dtype=torch.int32, device=dev)
    out = torch.empty(BATCH, dims.out_width, dtype=torch.bfloat16, device=dev)

    def inputs():  # new numbers into the captured buffers, each request's new token at its last position
        for x in (q, key, value):
            x.copy_(torch.randn(x.shape, generator=gen, device=dev))
        last = lens.long() - 1
        slots.copy_(table.long().gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE)

    def step():
        write_paged(kv, slots, key, value, codec=codec)
        if windowed:
            windowed_paged_attention(q, key, value, kv, ring, blocks, table, lens, starts, codec, scaling=0.125,
                                     sinks=SINKS, window=WINDOW, out=out, max_query_len=1, max_seq_len=LONGEST)
            write_ring(ring, blocks, lens, starts, key, value, sinks=SINKS, window=WINDOW, max_query_len=1)
        else:
            paged(q, kv, table, lens, starts, list(dims.d_k), list(dims.d_v), dims.group, scaling=0.125, out=out,
                  codec=codec, max_query_len=1, max_seq_len=LONGEST)

    inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and its tables built before the capture, as vLLM warms up
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    lens.add_(1)
    inputs()
    cache, rings = kv.clone(), ring.clone()
    graph.replay()
    torch.cuda.synchronize()
    got, got_cache, got_rings = out.clone(), kv.clone(), ring.clone()
    kv.copy_(cache)
    ring.copy_(rings)
    out.fill_(float("nan"))
    step()
    assert not out.isnan().any()
    assert torch.equal(got, out), float((got.float() - out.float()).abs().max())
    assert torch.equal(got_cache, kv) and torch.equal(got_rings, ring)
