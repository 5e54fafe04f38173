"""Reading the size of a live KV cache (any transformers Cache: the original's or a kvfold model's)."""

from __future__ import annotations

__all__ = ["kv_cache_bytes"]


def kv_cache_bytes(cache) -> int:
    """Bytes held by the keys and values of every layer of `cache`, as stored (no padding exists); a windowed
    export's layers (hf/window_cache.WindowLayer) also hold their sink and recent tokens' whole rows."""
    total = 0
    names = ("keys", "values", "whole_k", "whole_v", "recent_k", "recent_v")
    for layer in cache.layers:
        for t in (getattr(layer, name, None) for name in names):
            if t is not None and t.numel():
                total += t.numel() * t.element_size()
    return total
