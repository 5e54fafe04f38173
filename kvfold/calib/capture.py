"""See what attention sees, without copying any model code.

Q, K, V are taken inside transformers' attention interface: every supported model calls
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)` with q and k
*after* RoPE (and after QK-norm), shaped [B, H, T, d] / [B, H_kv, T, d]. We register a wrapper under
a new name that hands the tensors to a per-module tap and then runs the model's own implementation,
so outputs are unchanged. The attention output (the o_proj input) comes from a forward pre-hook.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from kvfold.adapters import Adapter

__all__ = ["OutTap", "QKVTap", "tapped"]

QKVTap = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]  # (layer, q, k, v)
OutTap = Callable[[int, torch.Tensor], None]  # (layer, o_proj input [B, T, H*d])
_TAP_ATTR = "_kvfold_tap"


def _inner_attention(module: nn.Module, name: str) -> Callable:
    if name == "eager":
        # "eager" is not in the global registry: each modeling file defines its own (Gemma2's adds
        # softcapping), so use the one of the module's own file.
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _register(inner: str) -> str:
    name = f"kvfold_capture_{inner}"

    def attention(module, query, key, value, attention_mask, **kwargs):
        tap = getattr(module, _TAP_ATTR, None)
        if tap is not None:
            tap(query, key, value)
        return _inner_attention(module, inner)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    # The wrapper needs exactly the mask the wrapped implementation would get.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


@contextmanager
def tapped(model: nn.Module, adapter: Adapter, on_qkv: QKVTap, on_out: OutTap) -> Iterator[None]:
    """Within the block, every forward pass reports per layer (q, k, v) and the o_proj input."""
    original = model.config._attn_implementation
    handles = []
    attns = adapter.attention_modules(model)
    try:
        model.set_attn_implementation(_register(original))
        for i, attn in enumerate(attns):
            setattr(attn, _TAP_ATTR, lambda q, k, v, i=i: on_qkv(i, q, k, v))
            o_proj = getattr(attn, adapter.o_proj)
            handles.append(o_proj.register_forward_pre_hook(lambda _m, args, i=i: on_out(i, args[0])))
        yield
    finally:
        for h in handles:
            h.remove()
        for attn in attns:
            if hasattr(attn, _TAP_ATTR):
                delattr(attn, _TAP_ATTR)
        model.set_attn_implementation(original)
