"""A windowed layer's prefill pieces (kernels/window_prefill.py): its whole part in C (cpu_window) gives what the
torch twin gives — uneven widths, a chunk after cached tokens, no window, more sinks than tokens — and the whole
prefill equals attention by the definition (each query's sinks and window whole, the rest from codes)."""

import pytest
import torch

from kvfold_runtime.kernels.cpu_bits import library
from kvfold_runtime.kernels.cpu_window import window_part_c
from kvfold_runtime.kernels.reference import reference_attention
from kvfold_runtime.kernels.window_prefill import _whole, whole_positions, windowed_prefill

CASES = [  # s, t, d_k, d_v, group, sinks, window
    (300, 300, [64, 64], [64, 64], 3, 16, 64), (300, 37, [6, 3, 17], [5, 8, 33], 2, 3, 5),
    (50, 50, [6, 3], [5, 8], 2, 7, 0), (20, 20, [8], [8], 1, 0, 4), (10, 4, [32], [32], 4, 16, 64),
    # the C path's queries a few at a time over transposed keys: groups of 5 and 7 (two, three batches), 128-wide
    # heads, no window (sinks only), a chunk
    (200, 200, [128, 128], [128, 128], 5, 4, 32), (40, 40, [32], [32], 6, 4, 0),
    (120, 50, [64, 64], [64, 64], 7, 16, 20)]


@pytest.mark.parametrize(("s", "t", "d_k", "d_v", "group", "sinks", "window"), CASES)
def test_the_whole_part_in_c_is_the_torch_one(s, t, d_k, d_v, group, sinks, window):
    assert library() is not None, "the C library does not build here (the dev environment has a compiler)"
    g = torch.Generator().manual_seed(s + t)
    rows = whole_positions(s, t, sinks, window).shape[0]
    q = torch.randn(t, group * sum(d_k), generator=g)
    k, v = torch.randn(rows, sum(d_k), generator=g), torch.randn(rows, sum(d_v), generator=g)
    args = (q, k, v, d_k, d_v, group, 0.2, sinks, window, s)
    got, want = window_part_c(*args), _whole(*args)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("s", "t", "d_k", "d_v", "group", "sinks", "window"), CASES)
def test_a_windowed_prefill_reads_each_querys_sinks_and_window_whole(s, t, d_k, d_v, group, sinks, window):
    g = torch.Generator().manual_seed(s * t)
    q = torch.randn(t, group * sum(d_k), generator=g)
    k, v = torch.randn(s, sum(d_k), generator=g), torch.randn(s, sum(d_v), generator=g)
    k_coded, v_coded = k + 0.3 * torch.randn(k.shape, generator=g), v + 0.3 * torch.randn(v.shape, generator=g)
    held = whole_positions(s, t, sinks, window)
    got = windowed_prefill(q, k_coded, v_coded, k[held], v[held], d_k, d_v, group, scaling=0.2, sinks=sinks,
                           window=window)
    for row in range(t):
        i = s - t + row
        whole = torch.tensor([j < sinks or i - j < window for j in range(i + 1)])[:, None]
        keys, values = torch.where(whole, k[:i + 1], k_coded[:i + 1]), torch.where(whole, v[:i + 1], v_coded[:i + 1])
        want = reference_attention(q[row][None, None], keys[None], values[None], d_k, d_v, group, scaling=0.2)[0, 0]
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("s", "t", "width", "group", "sinks", "window"),
                         [(300, 300, 64, 3, 16, 64), (200, 77, 128, 5, 4, 32), (90, 90, 32, 6, 7, 0)])
def test_the_whole_part_of_bfloat16_rows_in_pairs_is_the_float32_one(s, t, width, group, sinks, window, monkeypatch):
    """cpu_bits.c kvfold_window_part_bf16 (AVX512-BF16: pairs of numbers a lane, the probabilities rounded to
    bfloat16) against the torch twin in float32 on the same bfloat16 numbers: log-sum-exps as exact, outputs within
    the probabilities' rounding. Two KV heads, uneven sink and window starts, a chunk."""
    from kvfold_runtime.kernels import cpu_window

    fns = cpu_window._functions()
    if fns is None or fns[1] is None:
        pytest.skip("this CPU has no AVX512-BF16 (the float32 kernel serves bfloat16 rows there)")
    ran = []

    def counted(*args):
        ran.append(1)
        return fns[1](*args)

    monkeypatch.setattr(cpu_window, "_functions", lambda: (fns[0], counted))
    g = torch.Generator().manual_seed(s + width)
    rows = whole_positions(s, t, sinks, window).shape[0]
    q = torch.randn(t, group * 2 * width, generator=g).bfloat16()
    k, v = torch.randn(rows, 2 * width, generator=g).bfloat16(), torch.randn(rows, 2 * width, generator=g).bfloat16()
    args = ([width] * 2, [width] * 2, group, 0.2, sinks, window, s)
    got = window_part_c(q, k, v, *args)
    want = _whole(q.float(), k.float(), v.float(), *args)
    assert ran, "the bfloat16 kernel did not run"
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=8e-3)
