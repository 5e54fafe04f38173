"""A vLLM decode step of one layer as one C call (cpu_bits.c kvfold_decode_layer): the step's keys and values written
into their slots, then attention read straight from the paged cache — and, for a windowed bits layer, the step's whole
row written to its ring and the sinks and window read from there. The codec's arguments come from cpu_bits.
"""

from __future__ import annotations

import ctypes

import torch

from kvfold_runtime.bands import FIT_STEPS
from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels.cpu_bits import STEP_FORMATS, layer_args, library

__all__ = ["DecodeLayer"]

_RingArgs = ctypes.c_int64 * 7  # kvfold_decode_layer's `ring`


class DecodeLayer:
    """One layer's decode step as one C call (kvfold_decode_layer): the step's keys and values written into their slots
    (write_layer_slots_c's codes, or write_number_slots_c's numbers), then decode_attention_c over vLLM's block table
    and lengths, for a step in the model's dtype (STEP_FORMATS: float32, or bfloat16 and float16, widened to float32 in
    C as decode_attention_c's caller does in torch). Made once per layer, for its cache's row dtype (uint8 codes of a
    bits layer, or a rank layer's numbers in the model's dtype) and block size: everything that does not change from
    step to step is packed here once, so a step's Python is a few addresses and one call (at batch 1, over a short
    context, a layer's separate write and attention calls took 73–120 µs, nearly all Python and ctypes; this one 22–33).
    A windowed bits layer (kernels/paged_window.py) passes its rings: the step's whole rows are written there too, and
    each request reads its sinks and recent positions from them, the rest from codes. library() must not be None."""

    def __init__(self, dims: LayerDims, cache_dtype: torch.dtype, block_size: int) -> None:
        assert (cache_dtype == torch.uint8) if dims.banded else (cache_dtype in STEP_FORMATS)
        assert dims.group <= 64
        lay = layer_args(dims, cache_dtype)
        (k_seg, k_first), (v_seg, v_first) = lay.k_heads, lay.v_heads
        self._kept = lay  # the tensors whose addresses `_args` holds
        self._args = torch.tensor(
            [int(dims.banded), lay.key_bytes + lay.value_bytes, block_size, lay.key_bytes, len(dims.d_k), dims.group,
             lay.d_k.data_ptr(), lay.d_v.data_ptr(), lay.k_rows.data_ptr(), lay.k_rows.shape[0],
             lay.v_rows.data_ptr(), lay.v_rows.shape[0], k_seg.data_ptr(), k_first.data_ptr(), v_seg.data_ptr(),
             v_first.data_ptr(), lay.log8.data_ptr(), FIT_STEPS], dtype=torch.int64)
        self._row_bytes, self._block_size, self._call = lay.key_bytes + lay.value_bytes, block_size, \
            library().kvfold_decode_layer
        self._numbers = None if dims.banded else cache_dtype  # a rank layer's step: copied as it comes
        self._width = sum(dims.d_k) + sum(dims.d_v)  # a ring row's floats

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                 table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, scaling: float,
                 ring: tuple[torch.Tensor, torch.Tensor, int, int] | None = None) -> bool:
        """q [N, Σ_h d_k(g(h))] (any shape of those numbers, contiguous), k [N, …, Σ d_k] and v [N, …, Σ d_v] (unit
        stride along a row, any row stride), slots [N] int64, cache the layer's [num_blocks, …, block_size, C]
        (each block's rows contiguous, the blocks any stride apart: vLLM's block-outer layouts), table [N, ≥ blocks]
        int32 (unit stride along a row), seq_lens [N] int32 (the new tokens counted), out [N, …] contiguous; q, k,
        v, out in one of STEP_FORMATS (a rank layer's: its cache's); `ring`: (rows [ring_blocks, sinks + window,
        ≥ Σd_k + Σd_v] in q's dtype, unit stride along a row, ring_blocks [N] int32 each request's ring, sinks,
        window) -> True once written and attended; False (nothing done) where the tensors are not as described,
        for the caller's general path."""
        n = seq_lens.shape[0]
        block = cache.reshape(cache.shape[0], -1, cache.shape[-1])  # a view where each block's rows are contiguous
        fmt = STEP_FORMATS.get(q.dtype)
        if not (fmt is not None and q.dtype is k.dtype is v.dtype is out.dtype
                and self._numbers in (None, q.dtype) and q.is_contiguous()
                and out.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1 and slots.dtype is torch.int64
                and slots.shape[0] == n == q.shape[0] == k.shape[0] == v.shape[0] and table.dtype is torch.int32
                and table.stride(-1) == 1 and seq_lens.dtype is torch.int32 and seq_lens.is_contiguous()
                and slots.is_contiguous() and block.data_ptr() == cache.data_ptr() and block[0].is_contiguous()
                and cache.shape[-1] * cache.element_size() == self._row_bytes and cache.shape[-2] == self._block_size
                and q.device.type == "cpu"):
            return False
        windowed = None
        if ring is not None:
            rows, ring_blocks, sinks, window = ring
            if not (rows.dtype is q.dtype and rows.stride(-1) == 1 and rows.device.type == "cpu"
                    and rows.shape[-1] >= self._width and ring_blocks.shape[0] == n):
                return False
            ring_blocks = ring_blocks.to(torch.int32).contiguous()  # as it comes (vllm/ring.py): no copy
            windowed = _RingArgs(rows.data_ptr(), rows.stride(0), rows.stride(1), ring_blocks.data_ptr(), sinks,
                                 window, fmt)  # a ctypes array: a few µs less than a tensor, each layer and step
        if self._call(self._args.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
                      block.data_ptr(), block.stride(0) * block.element_size(), table.data_ptr(), table.stride(0),
                      seq_lens.data_ptr(), table.shape[1], q.data_ptr(), out.data_ptr(), n, scaling,
                      None if windowed is None else ctypes.addressof(windowed), fmt):
            raise MemoryError("kvfold: the C decode attention could not allocate its buffers")
        return True
