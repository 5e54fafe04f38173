"""The transformers cache layer of a windowed bits-format export: every token's band codes, and the first `sinks` and
last `window` tokens at the model's dtype as well (what a query reads whole: kernels/torch_window.py).

It is a DynamicLayer (the codes are its keys and values, so get_seq_length, masks and the default DynamicCache work
as for any export) that also keeps the whole rows. KVFoldAttention puts one in place of a fresh DynamicLayer
(`window_layer`) before the layer's first update. Its bytes: every token's codes plus at most sinks + window whole
rows (format.ConfigBlock.bytes_per_token counts them; in vLLM they live in rings, vllm/ring.py).

Batch reordering (beam search), repetition and selection apply to the whole rows too. `crop` drops the whole rows of
the tokens it removes; the tokens that then fall inside the window were already out of it and are read from their
codes until new ones take their place (an assisted-generation rollback reads those few as coded).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["WindowLayer", "window_layer"]


class WindowLayer(DynamicLayer):
    def __init__(self, sinks: int, window: int) -> None:
        super().__init__()
        self.sinks, self.window = sinks, window
        self.whole_k = self.whole_v = None  # [B, 1, ≤ sinks, Σ_g d] the sink rows
        self.recent_k = self.recent_v = None  # [B, 1, ≤ window, Σ_g d] the last rows
        self.recent_start = 0  # the position of recent_k's first row

    def keep(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Record the whole rows of the new tokens k, v [B, 1, T, Σ_g d] at positions start.. and return the whole
        rows the step's queries read: the cached recent rows and the new ones (at position `first` on) — the
        sinks are read from `whole_k` / `whole_v`."""
        if self.whole_k is None:
            self.whole_k, self.whole_v = k[:, :, :self.sinks], v[:, :, :self.sinks]
        elif self.whole_k.shape[2] < self.sinks and start < self.sinks:
            take = self.sinks - start
            self.whole_k = torch.cat([self.whole_k, k[:, :, :take]], 2)
            self.whole_v = torch.cat([self.whole_v, v[:, :, :take]], 2)
        if self.recent_k is None or self.recent_k.shape[2] == 0:
            rk, rv, first = k, v, start
        else:
            rk, rv, first = torch.cat([self.recent_k, k], 2), torch.cat([self.recent_v, v], 2), self.recent_start
        drop = max(0, rk.shape[2] - self.window)
        self.recent_k, self.recent_v, self.recent_start = rk[:, :, drop:], rv[:, :, drop:], first + drop
        return rk, rv, first

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        n = self.get_seq_length()
        if self.recent_k is not None:
            keep = max(0, n - self.recent_start)
            self.recent_k, self.recent_v = self.recent_k[:, :, :keep], self.recent_v[:, :, :keep]
            if keep == 0:
                self.recent_start = n
        if self.whole_k is not None:
            self.whole_k, self.whole_v = self.whole_k[:, :, :n], self.whole_v[:, :, :n]

    def reset(self) -> None:
        super().reset()
        self.whole_k = self.whole_v = self.recent_k = self.recent_v = None
        self.recent_start = 0

    def _batch(self, fn) -> None:
        for name in ("whole_k", "whole_v", "recent_k", "recent_v"):
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, fn(x))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._batch(lambda x: x[indices, ...])


def window_layer(cache, layer_idx: int, sinks: int, window: int) -> WindowLayer:
    """Layer `layer_idx` of `cache` (a transformers Cache), made a WindowLayer if it is a fresh DynamicLayer; a
    ValueError (with the fix) if it holds tokens of another kind."""
    layers = cache.layers
    while len(layers) <= layer_idx:  # a DynamicCache made without a config grows its layers on first use
        layers.append(DynamicLayer())
    layer = layers[layer_idx]
    if isinstance(layer, WindowLayer):
        return layer
    if type(layer) is not DynamicLayer or layer.get_seq_length() > 0:
        raise ValueError("a windowed kvfold export keeps its whole tokens in its own cache layers; use the default "
                         f"DynamicCache, empty (got {type(layer).__name__})")
    layers[layer_idx] = WindowLayer(sinks, window)
    return layers[layer_idx]
