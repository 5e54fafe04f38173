"""Attention over compressed, uneven per-head keys and values (packed layouts: see kvfold_runtime.format;
the paged layout that vLLM's block tables address, and the row codecs that store its rows — numbers in the
model's dtype or fp8, or a bits-format layer's band codes: see kvfold_runtime.kernels.paged).

reference.py is the oracle; torch_sdpa.py and paged.py the torch path (CPU, and fallbacks; torch_decode.py its
batched decode, torch_bits.py its writer and reader of band codes, cpu_bits.c/.py the same reader and decode
attention over band codes in C where a C compiler runs);
triton_decode.py / triton_prefill.py / triton_bits.py the GPU kernels (triton_common.py: their shared host-side
checks and tables); dispatch.py picks one per call (KVFOLD_KERNELS)."""

from kvfold_runtime.kernels.dispatch import attention, kernels_for
from kvfold_runtime.kernels.paged import BandRows, NumberRows, RowCodec, paged_attention, row_codec, write_paged
from kvfold_runtime.kernels.reference import reference_attention
from kvfold_runtime.kernels.torch_sdpa import sdpa_attention

__all__ = ["BandRows", "NumberRows", "RowCodec", "attention", "kernels_for", "paged_attention", "reference_attention",
           "row_codec", "sdpa_attention", "write_paged"]
