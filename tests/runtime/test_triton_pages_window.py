"""A windowed bits layer over the GPU page layout (kernels.paged_window where Triton runs): the decodes' codes part by
the page kernel over positions [sinks, i − window] only (triton_pages.history_parts), their sinks and window read
whole from the ring, the two merged by log-sum-exp; prefills and chunks decode their own pages. Whatever way a
request's tokens arrive, each query reads token j whole where j < sinks or i − j < window and from its codes
elsewhere — checked against that definition row by row, with contexts split in parts and pages shuffled in 0xFF-filled
blocks. On CUDA when there is one, else in Triton's interpreter."""

import contextlib
import os

import pytest
import torch

from kvfold_runtime.bands import decode_heads
from kvfold_runtime.kernels import row_codec, write_paged
from kvfold_runtime.kernels.paged import BandPages
from tests.conftest import rerun_in_triton_interpreter
from tests.runtime.test_triton_pages import LAYERS, _kv, _rows
from tests.runtime.windowed_steps import oracle, steps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEEDS_CHILD = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"
kernels = pytest.mark.skipif(NEEDS_CHILD, reason="no GPU: run in Triton's interpreter by test_in_the_interpreter")
SCALE, PAGE = 0.3, 16


@pytest.mark.skipif(not NEEDS_CHILD, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    rerun_in_triton_interpreter(__file__, "-k", "not test_in_the_interpreter")


@kernels
@pytest.mark.parametrize(("layer", "sinks", "window", "splits", "told"), [
    ("mixed", 4, 32, 3, False),  # sinks inside the first key block, a window of two pages, contexts in three parts
    ("eighths", 16, 64, None, True),  # 8-dim chunks (128-token key blocks); the default export's sinks and window
    ("eighths", 16, 64, 2, False),
    ("one head", 5, 0, 2, True),  # sinks only: a query's own row is a code
    ("mixed", 0, 20, None, False),  # a window only
    ("mixed", 3, 20, 3, True)])
def test_page_decodes_read_codes_and_ring_as_the_definition(layer, sinks, window, splits, told, monkeypatch):
    """`told`: the step as vLLM's backend describes it on the host (max_query_len, the decodes-first StepSplit),
    where a step of decodes reads nothing back from the device."""
    from kvfold_runtime.kernels import triton_pages
    from kvfold_runtime.kernels.dispatch import StepSplit
    from kvfold_runtime.kernels.paged_window import windowed_paged_attention, write_ring

    monkeypatch.setenv("KVFOLD_KERNELS", "triton")
    if splits is not None:  # the context's parts as a long context or a small batch gets them
        monkeypatch.setattr(triton_pages, "default_splits", lambda *a, **k: splits)
    calls = []
    real = triton_pages.history_parts
    monkeypatch.setattr(triton_pages, "history_parts", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    dims = LAYERS[layer]
    codec = row_codec(dims, page=PAGE)
    assert isinstance(codec, BandPages)
    g = torch.Generator().manual_seed(sinks + window)
    # per request, the tokens each step brings (0: not in that step): a long prefill then decodes; chunks (one
    # longer than the window) then decodes; a short prefill arriving late, then decodes
    schedule = [[150, 1, 1, 1], [40, 70, 1, 1], [0, 0, 9, 1]]
    total = [sum(s) for s in schedule]
    sides = [_kv(dims, n, g) for n in total]
    qs = [torch.randn(n, dims.q_width, generator=g) for n in total]
    k_bytes = dims.row_bytes()[0]
    coded = []
    for k, v in sides:
        rows = _rows(dims, k, v)
        coded.append((decode_heads(rows[:, :k_bytes], dims.d_k, dims.k_bands, torch.float32),
                      decode_heads(rows[:, k_bytes:], dims.d_v, dims.v_bands, torch.float32)))
    per = [-(-n // PAGE) for n in total]
    blocks = torch.randperm(sum(per) + 3, generator=g)[:sum(per)]  # shuffled; three blocks no request holds
    kv = torch.full((sum(per) + 3, 1, PAGE, codec.layout.row_bytes), 0xFF, dtype=torch.uint8, device=DEVICE)
    table = torch.zeros(3, max(per), dtype=torch.int32)
    for r, first in enumerate([0, per[0], per[0] + per[1]]):
        table[r, :per[r]] = blocks[first:first + per[r]]
    ring = torch.full((4, sinks + window, sum(dims.d_k) + sum(dims.d_v) + 5), float("nan"), device=DEVICE)
    ring_blocks = torch.tensor([2, 0, 3])
    for step in steps(schedule):
        reqs, starts = step.reqs, step.starts
        key, value = step.gather([k for k, _ in sides]).to(DEVICE), step.gather([v for _, v in sides]).to(DEVICE)
        query = step.gather(qs).to(DEVICE)
        out = torch.full((query.shape[0], dims.out_width), float("nan"), device=DEVICE)
        seq_lens = torch.tensor(step.lens, dtype=torch.int32)
        step_table = table[reqs].to(DEVICE)
        write_paged(kv, step.slots(table, PAGE).to(DEVICE), key, value, codec=codec)
        news = (starts[1:] - starts[:-1]).tolist()
        host = {}
        if told:  # vLLM's host copies: the longest query, and decodes first (its builder reorders the batch)
            decodes = news.index(max(news)) if max(news) > 1 else len(news)
            host = dict(max_query_len=max(news), max_seq_len=max(step.lens))
            if max(news) > 1:
                host["split"] = StepSplit(decodes, decodes, tuple((i, int(starts[i]), news[i], step.lens[i])
                                                                  for i in range(decodes, len(news))))
        lens_dev, starts_dev = seq_lens.to(DEVICE), starts.to(DEVICE)
        with _no_read_back(monkeypatch, told and max(news) == 1):
            windowed_paged_attention(query, key, value, kv, ring, ring_blocks[reqs].to(DEVICE), step_table, lens_dev,
                                     starts_dev, codec, scaling=SCALE, sinks=sinks, window=window, out=out, **host)
            write_ring(ring, ring_blocks[reqs].to(DEVICE), lens_dev, starts_dev, key, value, sinks=sinks,
                       window=window, max_query_len=host.get("max_query_len"))
        for i, r in enumerate(reqs):
            for row, p in enumerate(step.pos[i].tolist()):
                want = oracle(qs[r][p], *sides[r], *coded[r], p, sinks, window, list(dims.d_k), list(dims.d_v),
                              dims.group, SCALE)
                torch.testing.assert_close(out[starts[i] + row].cpu(), want, rtol=1e-4, atol=1e-4)
    assert calls == [1, 2, 3], "the decodes did not take the page kernel"  # a step's decodes, in one call


@contextlib.contextmanager
def _no_read_back(monkeypatch, forbid: bool):
    """Within the block (where `forbid`), a tensor read back to the host fails the test: .tolist(), .item(),
    .cpu() and .nonzero() (each a device sync on a GPU)."""
    if not forbid:
        yield
        return
    with monkeypatch.context() as m:
        for name in ("tolist", "item", "cpu", "nonzero"):
            m.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"a decode step called .{_n}()"))
        yield
