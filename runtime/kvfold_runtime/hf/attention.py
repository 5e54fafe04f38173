"""The attention module of an exported model: projections at their compressed widths, a cache that
stores k' and v' packed at those widths, attention on the short vectors with no decompression.

Per layer (row vectors; the algebra: docs/design.md in the kvfold repository):
  RoPE models:  q = RoPE(norm(x W_q)) A_h,  k' = (RoPE(norm(x W_k)) − s_g) B_g   (A, B: kvfold_q_post/k_post;
                s: kvfold_k_shift where the export has one, a constant softmax does not see)
  others:       q = x W_q',  k' = x W_k'   (A and B already folded into the weights)
  all:          v' = x W_v',  out = Σ_h attn_h(q, k', v') W_O'^h
It replaces the family's own attention module and keeps its child names (q_proj, ..., q_norm), so the
exported safetensors load unchanged.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer
from transformers.pytorch_utils import Conv1D

from kvfold_runtime.families import Family
from kvfold_runtime.format import K_POST, K_SHIFT, Q_POST, LayerDims
from kvfold_runtime.hf.window_cache import window_layer
from kvfold_runtime.kernels.dispatch import attention
from kvfold_runtime.kernels.torch_bits import decode_rows, encode_rows
from kvfold_runtime.kernels.torch_window import window_attention

__all__ = ["KVFoldAttention"]


def _projection(old: nn.Module, n_in: int, n_out: int, conv1d: bool) -> nn.Module:
    """A projection like `old` (same kind, bias, dtype, device) with new widths."""
    like = old.weight
    if conv1d:
        return Conv1D(n_out, n_in).to(device=like.device, dtype=like.dtype)
    return nn.Linear(n_in, n_out, bias=old.bias is not None, device=like.device, dtype=like.dtype)


class KVFoldAttention(nn.Module):
    def __init__(self, hf_attn: nn.Module, family: Family, dims: LayerDims, head_dim: int,
                 key_shift: bool = False, window: tuple[int, int] = (0, 0)) -> None:
        super().__init__()
        self.family, self.dims, self.head_dim = family, dims, head_dim
        self.sinks, self.window = window  # a windowed bits export's whole tokens (kernels/torch_window.py)
        self.layer_idx = hf_attn.layer_idx
        self.is_causal = True
        self.num_heads = dims.group * dims.num_kv_heads
        # OPT scales q right after q_proj and attends with scale 1; keep its order of operations.
        self.q_scale = hf_attn.scaling if family.prescale_q else None
        self.scaling = 1.0 if family.prescale_q else hf_attn.scaling
        self.softcap = getattr(hf_attn, "attn_logit_softcapping", None)
        hidden = hf_attn.config.hidden_size
        d, n_kv = head_dim, dims.num_kv_heads
        q_w, k_w = (self.num_heads * d, n_kv * d) if family.rope else (dims.q_width, sum(dims.d_k))
        v_w = sum(dims.d_v)
        if family.qkv_fused:
            old = getattr(hf_attn, family.qkv_fused)
            setattr(self, family.qkv_fused, _projection(old, hidden, q_w + k_w + v_w, family.conv1d))
            self.widths = (q_w, k_w, v_w)
        else:
            for name, width in ((family.q_proj, q_w), (family.k_proj, k_w), (family.v_proj, v_w)):
                setattr(self, name, _projection(getattr(hf_attn, name), hidden, width, family.conv1d))
        setattr(self, family.o_proj, _projection(getattr(hf_attn, family.o_proj), dims.out_width, hidden,
                                                 family.conv1d))
        if family.qk_norm:
            self.q_norm, self.k_norm = hf_attn.q_norm, hf_attn.k_norm
        if family.resid_dropout:
            self.resid_dropout = hf_attn.resid_dropout
        if family.rope:
            like = hf_attn.q_proj.weight
            self.register_parameter(Q_POST, nn.Parameter(
                torch.empty(d, dims.q_width, device=like.device, dtype=like.dtype), requires_grad=False))
            self.register_parameter(K_POST, nn.Parameter(
                torch.empty(d, sum(dims.d_k), device=like.device, dtype=like.dtype), requires_grad=False))
            self.key_shift = key_shift
            if key_shift:
                self.register_parameter(K_SHIFT, nn.Parameter(
                    torch.empty(n_kv * d, device=like.device, dtype=like.dtype), requires_grad=False))
            self._rope = importlib.import_module(family.module).apply_rotary_pos_emb

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f = self.family
        if f.qkv_fused:
            return getattr(self, f.qkv_fused)(x).split(self.widths, -1)
        return getattr(self, f.q_proj)(x), getattr(self, f.k_proj)(x), getattr(self, f.v_proj)(x)

    def _post_rope(self, q: torch.Tensor, k: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, T, H·d], k [B, T, H_kv·d] -> packed q [B, T, Σ_h d_k], k' [B, T, Σ_g d_k]."""
        b, t = q.shape[:2]
        q, k = q.view(b, t, -1, self.head_dim), k.view(b, t, -1, self.head_dim)
        if self.family.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, T, d], [B, H_kv, T, d]
        if self.key_shift:
            k = k - getattr(self, K_SHIFT).view(-1, 1, self.head_dim)
        a = getattr(self, Q_POST).split([self.dims.group * w for w in self.dims.d_k], 1)
        bk = getattr(self, K_POST).split(list(self.dims.d_k), 1)
        qs, ks, n = [], [], self.dims.group
        for g, w in enumerate(self.dims.d_k):
            a_g = a[g].view(self.head_dim, n, w).transpose(0, 1)  # [n, d, w]: one A_h per query head
            qs.append((q[:, g * n:(g + 1) * n] @ a_g).transpose(1, 2).reshape(b, t, n * w))
            ks.append(k[:, g] @ bk[g])  # [B, T, w]
        return torch.cat(qs, -1), torch.cat(ks, -1)

    def _cached(self, k: torch.Tensor, v: torch.Tensor, cache) -> tuple[torch.Tensor, ...]:
        """Append this step's k', v' [B, 1, T, Σ_g d] to the cache (if any) and return every cached token's. A
        bits-format layer stores the band codes and scales (uint8 rows, kvfold_runtime.bands) and reads
        them back dequantized, so attention sees exactly what the cache holds. A windowed one also returns the
        keys and values with its whole tokens' rows in place (`_whole`): (k, v, k coded, v coded)."""
        if not self.dims.banded:
            return (k, v) if cache is None else cache.update(k, v, self.layer_idx)
        dk, dv = self.dims.d_k, self.dims.d_v
        # encode_rows / decode_rows: bands.encode_heads' bytes and decode_heads' values, table-driven (and in C on
        # a CPU): a generated token's step reads every cached row back
        k_rows, v_rows = encode_rows(k, dk, self.dims.k_bands), encode_rows(v, dv, self.dims.v_bands)
        layer = None
        if cache is not None:  # without a cache (use_cache=False) attention still reads the stored form
            if self.sinks or self.window:
                layer = window_layer(cache, self.layer_idx, self.sinks, self.window)
            start = cache.get_seq_length(self.layer_idx)
            k_rows, v_rows = cache.update(k_rows, v_rows, self.layer_idx)
        k_hat = decode_rows(k_rows, dk, self.dims.k_bands, k.dtype)
        v_hat = decode_rows(v_rows, dv, self.dims.v_bands, v.dtype)
        if not (self.sinks or self.window):
            return k_hat, v_hat
        t = k.shape[2]
        if layer is None:
            whole_k, whole_v, recent_k, recent_v, first = k[:, :, :self.sinks], v[:, :, :self.sinks], k, v, 0
        else:
            recent_k, recent_v, first = layer.keep(k, v, start)
            whole_k, whole_v = layer.whole_k, layer.whole_v
        return (self._whole(k_hat, whole_k, recent_k, first, t), self._whole(v_hat, whole_v, recent_v, first, t),
                k_hat, v_hat)

    def _whole(self, coded: torch.Tensor, sinks: torch.Tensor, recent: torch.Tensor, first: int,
               t: int) -> torch.Tensor:
        """`coded` [B, 1, S, Σ_g d] with the rows a step of `t` queries may read whole put back: the sinks, and the
        recent rows (from position `first`) from the first any query's window reaches."""
        out = coded.clone()
        s = out.shape[2]
        out[:, :, :sinks.shape[2]] = sinks
        lo = max(first, s - t - self.window + 1)
        if self.window and lo < s:
            out[:, :, lo:] = recent[:, :, lo - first:]
        return out

    def _per_row(self, t: int, s: int) -> bool:
        """Whether query rows read different tokens whole: some token past the sinks is inside the first query's
        window and outside the last one's (kernels/torch_window.py)."""
        return t > 1 and self.window > 0 and max(self.sinks, s - t - self.window + 1) < s - self.window

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs) -> tuple[torch.Tensor, None]:
        q, k, v = self._qkv(hidden_states)
        if self.family.rope:
            q, k = self._post_rope(q, k, position_embeddings)
        if self.q_scale is not None:
            q = q * self.q_scale
        k, v = k[:, None], v[:, None]  # [B, 1, T, Σ_g d]: what the cache stores, one tensor per layer
        if past_key_values is not None:
            layers = past_key_values.layers  # a DynamicCache() made without a config grows them in update()
            if self.layer_idx < len(layers) and not isinstance(layers[self.layer_idx], DynamicLayer):
                raise ValueError("kvfold exports store packed, per-head-width keys; use the default DynamicCache "
                                 f"(got {type(layers[self.layer_idx]).__name__}: remove cache_implementation)")
        cached = self._cached(k, v, past_key_values)
        if len(cached) == 4 and self._per_row(q.shape[1], cached[2].shape[2]):
            out = window_attention(q, *(x[:, 0] for x in cached), list(self.dims.d_k), list(self.dims.d_v),
                                   self.dims.group, scaling=self.scaling, sinks=self.sinks, window=self.window,
                                   mask=attention_mask)
        else:  # every query reads the same tokens whole (or none): their rows are in place, one attention call
            k, v = cached[:2]
            out = attention(q, k[:, 0], v[:, 0], list(self.dims.d_k), list(self.dims.d_v), self.dims.group,
                            scaling=self.scaling, mask=attention_mask, softcap=self.softcap)
        out = getattr(self, self.family.o_proj)(out)
        if self.family.resid_dropout:
            out = self.resid_dropout(out)
        return out, None
