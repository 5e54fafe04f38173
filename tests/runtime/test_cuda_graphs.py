"""A bits layer's decode step on the GPU page layout captured in a CUDA graph, as vLLM's FULL cudagraph mode would
capture a batch of decodes: the plain layer's (codes written to their page slots, then the page kernel) and the
windowed layer's (codes written, the page kernel over the codes part, the ring's sinks and window and the merge,
the step's rows written to the rings) — the steps `kvfold-bench kernels` times (kvfold_bench.kernel_steps).
Capture fails on any read back to the host; a replay with every request one token longer and new queries in the
captured buffers must give what the same step gives run eagerly. What would let kvfold's vLLM backend declare
CUDA-graph support for decodes (not declared yet: this test has not run on a GPU). On CUDA only."""

import pytest
import torch

from kvfold_bench.kernel_steps import graphed, paged_step, windowed_step
from kvfold_bench.kernels import _bits_layers, _pages

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BATCH, TOKENS, LONGEST = 3, 199, 208  # each request 199 tokens, then 200 at the replay; pages hold 208


@pytest.mark.parametrize("make", [paged_step, windowed_step], ids=["plain", "windowed"])
def test_a_decode_step_replays_from_a_cuda_graph(make, monkeypatch):
    monkeypatch.setenv("KVFOLD_KERNELS", "triton")
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(3)
    layer = _bits_layers(num_heads=8, num_kv_heads=2, head_dim=64)[1]  # keys 8/5/4, values 6/4 bits
    kv, table, lens, starts = _pages(layer, BATCH, LONGEST, dev, gen)
    lens.fill_(TOKENS)
    q = torch.randn(BATCH, layer.dims.q_width, generator=gen, device=dev).to(torch.bfloat16)
    step = make(layer, q, kv, table, lens, starts, LONGEST, 0.125, gen)
    out = step()  # its output buffer, the one the graph writes
    replay = graphed(step)

    lens.add_(1)  # read by the kernels on the device: the replay sees the requests one token longer
    q.copy_(torch.randn(q.shape, generator=gen, device=dev))
    replay()
    torch.cuda.synchronize()
    got = out.clone()
    out.fill_(float("nan"))
    assert step() is out
    assert not out.isnan().any()
    # the replay's writes (the codes at their slots, the rows in the rings) are the ones the eager step makes again
    assert torch.equal(got, out), float((got.float() - out.float()).abs().max())
