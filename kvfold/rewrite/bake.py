"""Bake factors into weights: the model (itself, or a copy) with projections of the compressed widths.

Every projection is handled as W [in, out] (nn.Linear stores [out, in], GPT-2's Conv1D [in, out]).
Per KV head g / query head h (see factors/base.py):
  v_proj:  out cols of head g  ← W_v^g A_v            (bias too)      -> [hidden, Σ_g d_v]
  o_proj:  in rows of head h   ← B_hᵀ W_O^h                             -> [Σ_h d_v(g(h)), hidden]
  RoPE models: A_h, B_g stay online, as parameters `kvfold_q_post` [d, Σ_h d_k] and
               `kvfold_k_post` [d, Σ_g d_k] of the attention module (applied after RoPE), and the keys' shift
               `kvfold_k_shift` [H_kv · d] where the factors carry one (subtracted before B_g).
  no RoPE:     q_proj cols of head h ← W_q^h A_h, k_proj cols of head g ← W_k^g B_g (biases too).
Products are formed in float64 on the weights' device and cast to the model's dtype once, at the end.
In place (export), one layer's attention projections at a time are replaced: besides the model, only that
layer's float64 products exist (a few [hidden, hidden] matrices); every other tensor is the model's own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from kvfold.adapters import Adapter, HeadLayout
from kvfold.factors import LayerFactors
from kvfold_runtime import K_POST, K_SHIFT, Q_POST

__all__ = ["bake", "make_projection"]


def _read(module: nn.Module, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = module.weight.detach().to(torch.float64)
    b = None if module.bias is None else module.bias.detach().to(torch.float64)
    return (w if layout == "conv1d" else w.T), b


def make_projection(w_io: torch.Tensor, b: torch.Tensor | None, layout: str, dtype: torch.dtype) -> nn.Module:
    """A Linear (or Conv1D) holding w_io [in, out] in `dtype`, on w_io's device."""
    n_in, n_out = w_io.shape
    if layout == "conv1d":
        mod = Conv1D(n_out, n_in).to(w_io.device)
        mod.weight.data = w_io.to(dtype).contiguous()
        mod.bias.data = (torch.zeros(n_out, dtype=torch.float64, device=w_io.device) if b is None else b).to(dtype)
        return mod
    mod = nn.Linear(n_in, n_out, bias=b is not None, dtype=dtype, device=w_io.device)
    mod.weight.data = w_io.T.to(dtype).contiguous()
    if b is not None:
        mod.bias.data = b.to(dtype)
    return mod


def _heads_out(w, b, mats: list[torch.Tensor], d: int):
    """Map output columns of head i through mats[i] ([d, r_i]); concatenate the heads."""
    mats = [m.to(w.device) for m in mats]
    w2 = torch.cat([w[:, i * d : (i + 1) * d] @ m for i, m in enumerate(mats)], 1)
    b2 = None if b is None else torch.cat([b[i * d : (i + 1) * d] @ m for i, m in enumerate(mats)])
    return w2, b2


def bake(model: nn.Module, adapter: Adapter, factors: list[LayerFactors], *, in_place: bool = False) -> nn.Module:
    """Return `model` baked: a deep copy (the original is untouched), or with `in_place` the model itself, its
    attention projections replaced layer by layer (what export writes; no second model is ever held)."""
    layout = HeadLayout.from_config(model.config)
    d, dtype, pl = layout.head_dim, next(model.parameters()).dtype, adapter.proj_layout
    baked = model if in_place else copy.deepcopy(model)
    for attn, f in zip(adapter.attention_modules(baked), factors, strict=True):
        if adapter.qkv_fused:
            w, b = _read(getattr(attn, adapter.qkv_fused), pl)
            n = layout.num_heads * d
            parts = [(w[:, i * n : (i + 1) * n], None if b is None else b[i * n : (i + 1) * n]) for i in range(3)]
        else:
            parts = [_read(getattr(attn, name), pl) for name in (adapter.q_proj, adapter.k_proj, adapter.v_proj)]
        (wq, bq), (wk, bk), (wv, bv) = parts
        wv, bv = _heads_out(wv, bv, f.v_a, d)
        if not adapter.rope:
            wq, bq = _heads_out(wq, bq, f.qk_a, d)
            wk, bk = _heads_out(wk, bk, f.qk_b, d)
        else:
            for name, mats in ((Q_POST, f.qk_a), (K_POST, f.qk_b)):
                post = torch.cat(mats, 1).to(wq.device, dtype)
                attn.register_parameter(name, nn.Parameter(post, requires_grad=False))
            if f.k_mean is not None:
                shift = f.k_mean.reshape(-1).to(wq.device, dtype)
                attn.register_parameter(K_SHIFT, nn.Parameter(shift, requires_grad=False))
        if adapter.qkv_fused:
            b_all = None if bq is None else torch.cat([bq, bk, bv])
            setattr(attn, adapter.qkv_fused, make_projection(torch.cat([wq, wk, wv], 1), b_all, pl, dtype))
        else:
            for name, (w, b) in zip((adapter.q_proj, adapter.k_proj, adapter.v_proj),
                                    ((wq, bq), (wk, bk), (wv, bv)), strict=True):
                setattr(attn, name, make_projection(w, b, pl, dtype))
        wo, bo = _read(getattr(attn, adapter.o_proj), pl)  # [H*d, hidden]
        wo = torch.cat([b_h.T.to(wo.device) @ wo[h * d : (h + 1) * d] for h, b_h in enumerate(f.o_b)], 0)
        setattr(attn, adapter.o_proj, make_projection(wo, bo, pl, dtype))
    return baked
