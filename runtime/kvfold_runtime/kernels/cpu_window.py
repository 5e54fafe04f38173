"""The whole part of a windowed bits layer's prefill in C (cpu_bits.c `kvfold_window_part`): each query over its
sinks and window rows alone, with its log-sum-exp (kernels/window_prefill.py merges it with the history's causal
attention). The torch twin (window_prefill._whole) forms its scores per block of queries over the block's whole span
of window rows, most of them masked; here each query reads just its own rows, its group's queries over the same rows
in turn: one SmolLM2 layer at 4K tokens, 12 ms against torch's 31 (2 cores; the history's causal attention ~130)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvfold_runtime.kernels.cpu_bits import library

__all__ = ["window_part_c"]


@functools.cache
def _function():
    """kvfold_window_part with its argument types, or None where the C library does not build."""
    lib = library()
    if lib is None:
        return None
    fn = lib.kvfold_window_part
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    fn.restype = None
    fn.argtypes = [p, i64, i64, p, i64, i64, p, i64, p, p, i32, i32, i64, i64, i64, ctypes.c_float, p, i64, p]
    return fn


def window_part_c(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int], group: int,
                  scaling: float, sinks: int, window: int, s: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """window_prefill._whole's contract (float32 q [t, ·], k and v the rows of whole_positions) in one C call, or
    None where C does not run (no library, tensors off the CPU or not float32 rows of unit stride)."""
    fn = _function()
    if fn is None or not all(x.device.type == "cpu" and x.dtype is torch.float32 and x.stride(-1) == 1
                             for x in (q, k, v)):
        return None
    q = q.contiguous()
    t, heads = q.shape[0], len(d_k)
    out = q.new_zeros(t, heads, group, max(d_v))  # a narrower head's columns past its width: 0, as _whole's
    lse = q.new_empty(t, heads, group)
    widths_k, widths_v = torch.tensor(d_k, dtype=torch.int32), torch.tensor(d_v, dtype=torch.int32)
    fn(q.data_ptr(), t, q.shape[1], k.data_ptr(), k.shape[0], k.stride(0), v.data_ptr(), v.stride(0),
       widths_k.data_ptr(), widths_v.data_ptr(), heads, group, s, sinks, window, scaling, out.data_ptr(), max(d_v),
       lse.data_ptr())
    return out, lse
