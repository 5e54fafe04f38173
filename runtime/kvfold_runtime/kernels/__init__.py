"""Attention over compressed, uneven per-head keys and values (packed layouts: see kvfold_runtime.dims;
the paged layout that vLLM's block tables address: see kvfold_runtime.kernels.paged)."""

from kvfold_runtime.kernels.paged import paged_attention, write_paged
from kvfold_runtime.kernels.reference import reference_attention
from kvfold_runtime.kernels.torch_sdpa import sdpa_attention

__all__ = ["paged_attention", "reference_attention", "sdpa_attention", "write_paged"]
