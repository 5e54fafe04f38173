"""Reading the size of a live KV cache (any transformers Cache: the original's or a kvfold model's)."""

from __future__ import annotations

__all__ = ["kv_cache_bytes"]


def kv_cache_bytes(cache) -> int:
    """Bytes held by the keys and values of every layer of `cache`, as stored (no padding exists)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and t.numel():
                total += t.numel() * t.element_size()
    return total
