"""The whole part of a windowed bits layer's prefill in C (cpu_bits.c `kvfold_window_part`): each query over its
sinks and window rows alone, with its log-sum-exp (kernels/window_prefill.py merges it with the history's causal
attention). The torch twin (window_prefill._whole) forms its scores per block of queries over the block's whole span
of window rows, most of them masked; here each query reads just its own rows, its group's queries together over the
same rows. Rows in bfloat16 on a CPU with AVX512-BF16 take `kvfold_window_part_bf16` (pairs of numbers a lane).
One SmolLM2 layer at 4K tokens on one AVX-512 core: 21 ms a query at a time in float32, 19 ms a group at a time,
14 ms in bfloat16 (the history's causal attention ~245)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvfold_runtime.kernels.cpu_bits import library

__all__ = ["window_part_c"]


@functools.cache
def _functions():
    """(kvfold_window_part, kvfold_window_part_bf16 or None where the CPU lacks AVX512-BF16) with their argument
    types, or None where the C library does not build."""
    lib = library()
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    args = [p, i64, i64, p, i64, i64, p, i64, p, p, i32, i32, i64, i64, i64, ctypes.c_float, p, i64, p]
    fn = lib.kvfold_window_part
    fn.restype, fn.argtypes = None, args
    bf16 = getattr(lib, "kvfold_window_part_bf16", None)
    if bf16 is not None:
        bf16.restype, bf16.argtypes = ctypes.c_int, args
    return fn, bf16


def window_part_c(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int], group: int,
                  scaling: float, sinks: int, window: int, s: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """window_prefill._whole's contract (q [t, ·], k and v the rows of whole_positions, float32 or all three
    bfloat16; outputs float32) in one C call, or None where C does not run (no library, tensors off the CPU or
    not rows of unit stride in those dtypes)."""
    fns = _functions()
    if fns is None or not (q.dtype is k.dtype is v.dtype and q.dtype in (torch.float32, torch.bfloat16)
                           and all(x.device.type == "cpu" and x.stride(-1) == 1 for x in (q, k, v))):
        return None
    fn, bf16 = fns
    t, heads = q.shape[0], len(d_k)
    out = q.new_zeros(t, heads, group, max(d_v), dtype=torch.float32)  # a narrower head's columns past its width: 0
    lse = q.new_empty(t, heads, group, dtype=torch.float32)
    widths_k, widths_v = torch.tensor(d_k, dtype=torch.int32), torch.tensor(d_v, dtype=torch.int32)

    def call(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        q = q.contiguous()
        return kernel(q.data_ptr(), t, q.shape[1], k.data_ptr(), k.shape[0], k.stride(0), v.data_ptr(), v.stride(0),
                      widths_k.data_ptr(), widths_v.data_ptr(), heads, group, s, sinks, window, scaling, out.data_ptr(),
                      max(d_v), lse.data_ptr())

    # the bfloat16 kernel: pairs of dims, 16 lanes; each head's key and value widths equal, 32, 64 or 128; it
    # returns 0 where its buffers could not be allocated
    if q.dtype is torch.bfloat16 and bf16 is not None and all(
            dk == dv and dk in (32, 64, 128) for dk, dv in zip(d_k, d_v, strict=True)) and call(bf16, q, k, v):
        return out, lse
    call(fn, q.float(), k.float(), v.float())  # float32 rows (the same tensors where they are)
    return out, lse
