"""See what attention sees, without copying any model code.

Q, K, V are taken inside transformers' attention interface: every supported model calls
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)` with q and k
*after* RoPE (and after QK-norm), shaped [B, H, T, d] / [B, H_kv, T, d]. We register a wrapper under
a new name that hands the tensors to a per-module patch around the model's own implementation: a tap
that only looks (calibration: outputs unchanged) or one that projects q and the output (evaluating a
candidate compression without re-exporting). The o_proj input for calibration comes from a pre-hook.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from kvfold.adapters import Adapter
from kvfold_runtime import window_reads

__all__ = ["AttentionPatch", "OutTap", "QKVTap", "exact_recent_attention", "patched", "tapped"]

QKVTap = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]  # (layer, q, k, v)
OutTap = Callable[[int, torch.Tensor], None]  # (layer, o_proj input [B, T, H*d])
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_PATCH_ATTR = "_kvfold_patch"


@dataclass(frozen=True)
class AttentionPatch:
    """What to do around one layer's attention call. `before` gets and returns (q, k, v) as
    [B, H, T, d] / [B, H_kv, T, d]; `after` gets and returns the attention output [B, T, H, d]."""

    before: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], QKV] | None = None
    after: Callable[[torch.Tensor], torch.Tensor] | None = None
    # (sinks, window): a cache that keeps its first `sinks` tokens and each query's `window` most recent ones (the
    # query's own included) whole, and only the others as `before` left them. Whole: as `whole` gives them, i.e.
    # `before` without the cache's rounding (a method that maps q or the basis must give it; None: the keys and
    # values as the model made them, right for methods that only round them)
    exact: tuple[int, int] | None = None
    whole: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], QKV] | None = None


# query rows per block of exact_recent_attention: one SDPA over the keys the block reads, not [T, T] at once
_ROWS = 512


def exact_recent_attention(query: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor],
                           cached: tuple[torch.Tensor, torch.Tensor], sinks: int, window: int, *,
                           scaling: float) -> torch.Tensor:
    """Causal attention as a cache that keeps sink and recent tokens whole serves it: query i reads key and value
    j as `exact` (k, v) has them where j < sinks or i − j < window, else as `cached` (k, v) has them. q
    [B, H, T, d], keys and values [B, H_kv, T, d] (GQA: query head h reads KV head h // (H / H_kv)) -> [B, T, H, d],
    as transformers' attention functions return it; scores times `scaling`, float32 softmax."""
    group = query.shape[1] // exact[0].shape[1]
    t = query.shape[2]
    if window == 0 or window >= t:  # every query reads the same tokens whole: one causal attention on a mixed cache
        whole = torch.arange(t, device=query.device) < (t if window else sinks)
        k, v = (torch.where(whole[:, None], w, c).repeat_interleave(group, dim=1).float()
                for w, c in zip(exact, cached, strict=True))
        out = F.scaled_dot_product_attention(query.float(), k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2).to(query.dtype)
    # Per block of _ROWS queries [a, e), one SDPA over just the keys the block reads, each once: the sinks below its
    # band, the whole rows of its band [a − window + 1, e), the codes of [sinks, e − window); the mask says which
    # query reads which. Close to one causal attention's work; forming both full score matrices per block and
    # choosing entries (the first version) took 5.9x as long for a SmolLM2 layer at 4,096 tokens on 2 cores.
    q = query.float()
    k0, v0, k1, v1 = (x.float() for x in (*exact, *cached))
    out = []
    for a in range(0, t, _ROWS):
        e = min(a + _ROWS, t)
        mask, whole, coded = window_reads(a, e, sinks, window, query.device)  # as the runtime serves them
        k = torch.cat([k0[:, :, whole], k1[:, :, coded]], 2)
        v = torch.cat([v0[:, :, whole], v1[:, :, coded]], 2)
        out.append(F.scaled_dot_product_attention(q[:, :, a:e], k, v, attn_mask=mask, scale=scaling,
                                                  enable_gqa=group > 1))
    return torch.cat(out, dim=2).transpose(1, 2).to(query.dtype)


def _inner_attention(module: nn.Module, name: str) -> Callable:
    if name == "eager":
        # "eager" is not in the global registry: each modeling file defines its own (Gemma2's adds
        # softcapping), so use the one of the module's own file.
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _register(inner: str) -> str:
    name = f"kvfold_patch_{inner}"

    def attention(module, query, key, value, attention_mask, **kwargs):
        patch: AttentionPatch | None = getattr(module, _PATCH_ATTR, None)
        if patch is not None and patch.exact is not None:
            q, k, v = patch.before(query, key, value) if patch.before is not None else (query, key, value)
            if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
                raise ValueError("AttentionPatch.exact: softcapped or sliding-window attention is not supported")
            scaling = kwargs.get("scaling")
            _, key, value = patch.whole(query, key, value) if patch.whole is not None else (query, key, value)
            out, weights = exact_recent_attention(q, (key, value), (k, v), *patch.exact,
                                                  scaling=module.scaling if scaling is None else scaling), None
        else:
            if patch is not None and patch.before is not None:
                query, key, value = patch.before(query, key, value)
            out, weights = _inner_attention(module, inner)(module, query, key, value, attention_mask, **kwargs)
        if patch is not None and patch.after is not None:
            out = patch.after(out)
        return out, weights

    AttentionInterface.register(name, attention)
    # The wrapper needs exactly the mask the wrapped implementation would get.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


@contextmanager
def patched(model: nn.Module, adapter: Adapter, patches: dict[int, AttentionPatch]) -> Iterator[None]:
    """Within the block, layer i's attention call runs through patches[i]; outside, nothing changes."""
    original = model.config._attn_implementation
    attns = adapter.attention_modules(model)
    try:
        model.set_attn_implementation(_register(original))
        for i, patch in patches.items():
            setattr(attns[i], _PATCH_ATTR, patch)
        yield
    finally:
        for attn in attns:
            if hasattr(attn, _PATCH_ATTR):
                delattr(attn, _PATCH_ATTR)
        model.set_attn_implementation(original)


@contextmanager
def tapped(model: nn.Module, adapter: Adapter, on_qkv: QKVTap, on_out: OutTap) -> Iterator[None]:
    """Within the block, every forward pass reports per layer (q, k, v) and the o_proj input."""

    def observe(i: int) -> AttentionPatch:
        def before(q, k, v):
            on_qkv(i, q, k, v)
            return q, k, v

        return AttentionPatch(before=before)

    attns = adapter.attention_modules(model)
    handles = [
        getattr(attn, adapter.o_proj).register_forward_pre_hook(lambda _m, args, i=i: on_out(i, args[0]))
        for i, attn in enumerate(attns)
    ]
    try:
        with patched(model, adapter, {i: observe(i) for i in range(len(attns))}):
            yield
    finally:
        for h in handles:
            h.remove()
