"""Attention over compressed, uneven per-head keys and values (packed layouts: see kvfold_runtime.dims)."""

from kvfold_runtime.kernels.reference import reference_attention
from kvfold_runtime.kernels.torch_sdpa import sdpa_attention

__all__ = ["reference_attention", "sdpa_attention"]
