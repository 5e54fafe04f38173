"""The attention module of a kvfold export inside vLLM (Llama-like RoPE families).

Per layer (row vectors; the same algebra as kvfold_runtime.hf.attention):
  q = RoPE(norm(x W_q)) A_h,  k' = RoPE(norm(x W_k)) B_g,  v' = x W_v',  out = Σ_h attn_h(q, k', v') W_O'^h
vLLM's own rotary embedding runs first; the post-RoPE projections A (`kvfold_q_post`, [d, Σ_h d_k(g(h))])
and B (`kvfold_k_post`, [d, Σ_g d_k]) are held block-diagonally ([H·d, Σ_h d_k(g(h))] and
[H_kv·d, Σ_g d_k]) so each is one matmul on vLLM's flat [T, H·d] query and [T, H_kv·d] key; the
checkpoint's compact tensors are scattered into the blocks by their weight loaders.

The layer's `Attention` declares one KV head of width Σd_k / Σd_v and `group` query heads of width Σd_k
(see kvfold_runtime.vllm.backend): the packed vectors pass through vLLM's reshapes unchanged. It is vLLM's
Attention except for the KV cache spec of a bits-format layer (KVFoldAttentionLayer): a page of uint8 rows of
the layer's band codes and scales, LayerDims.row_bytes() per token.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import KVQuantMode

from kvfold_runtime.format import K_POST, Q_POST, LayerDims, head_dim, model_dims
from kvfold_runtime.vllm.backend import KVFoldAttentionBackend
from kvfold_runtime.vllm.errors import refuse

__all__ = ["KVFoldAttentionLayer", "KVFoldVllmAttention"]


def _block_diagonal_loader(head_dim: int, widths: list[int]):
    """Weight loader: the checkpoint's [d, Σ widths] -> block i of [len(widths)·d, Σ widths]."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (head_dim, sum(widths)):
            raise refuse(f"post-RoPE projection has shape {tuple(loaded.shape)}, expected "
                         f"{(head_dim, sum(widths))} from config.json's ranks: the export is corrupt; "
                         "run `kvfold verify` on it")
        param.data.zero_()
        col = 0
        for i, w in enumerate(widths):
            param.data[i * head_dim:(i + 1) * head_dim, col:col + w] = loaded[:, col:col + w]
            col += w

    return load


class KVFoldAttentionLayer(Attention):
    """vLLM's Attention layer whose KV cache spec, for a bits-format layer, is the export's bytes: uint8 rows of
    Σ LayerDims.row_bytes() (keys' band codes and scales, then values'), so vLLM's page is block_size × those
    bytes and its own block count gives the capacity. vLLM's spec stays as it is otherwise (its Full or
    SlidingWindow type and block size; the declared widths, which vLLM's reshapes of q, k, v use), and so does
    a rank-format layer's whole spec."""

    def __init__(self, *args, kvfold_dims: LayerDims, **kwargs) -> None:
        super().__init__(*args, kvfold_dims=kvfold_dims, **kwargs)  # kvfold_dims also reaches the backend's impl
        self.kvfold_row_bytes = sum(kvfold_dims.row_bytes()) if kvfold_dims.banded else None

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if spec is None or self.kvfold_row_bytes is None:
            return spec
        return dataclasses.replace(spec, dtype=torch.uint8, kv_quant_mode=KVQuantMode.NONE,
                                   state_content_bytes=self.kvfold_row_bytes)


class KVFoldVllmAttention(nn.Module):
    """Takes LlamaDecoderLayer's attention arguments (it is passed as `attn_layer_type`)."""

    # set per model class (kvfold_runtime.vllm.models): QKV bias default and QK-norm
    qkv_bias: bool | None = None  # None: as the decoder layer says (the config's attention_bias)
    o_bias: bool | None = None
    qk_norm: bool = False

    def __init__(self, config, hidden_size: int, num_heads: int, num_kv_heads: int,
                 max_position_embeddings: int = 8192, quant_config=None, bias: bool = False,
                 bias_o_proj: bool = False, cache_config=None, prefix: str = "", attn_type: str = "decoder") -> None:
        super().__init__()
        if get_tensor_model_parallel_world_size() != 1:
            raise refuse("kvfold exports are served with tensor_parallel_size=1 for now")
        if quant_config is not None:
            raise refuse("kvfold exports are unquantized checkpoints; drop --quantization")
        layer = extract_layer_index(prefix)
        dims: LayerDims = model_dims(config)[layer]  # checked by the model class before any layer is built
        self.dims = dims
        self.head_dim = d = head_dim(config)
        self.q_full, self.k_full = num_heads * d, num_kv_heads * d
        qkv_bias = bias if self.qkv_bias is None else self.qkv_bias
        self.qkv_proj = MergedColumnParallelLinear(hidden_size, [self.q_full, self.k_full, sum(dims.d_v)],
                                                   bias=qkv_bias, prefix=f"{prefix}.qkv_proj")
        o_bias = bias_o_proj if self.o_bias is None else self.o_bias
        self.o_proj = RowParallelLinear(dims.out_width, hidden_size, bias=o_bias, prefix=f"{prefix}.o_proj")
        if self.qk_norm:
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(d, max_position=max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None), is_neox_style=True)
        q_widths = [w for w in dims.d_k for _ in range(dims.group)]  # query head h reads KV head h // group
        for name, rows, widths in ((Q_POST, self.q_full, q_widths), (K_POST, self.k_full, list(dims.d_k))):
            post = nn.Parameter(torch.zeros(rows, sum(widths)), requires_grad=False)
            post.weight_loader = _block_diagonal_loader(d, widths)
            self.register_parameter(name, post)
        sliding_window = None
        if (types := getattr(config, "layer_types", None)) and types[layer] == "sliding_attention":
            sliding_window = config.sliding_window
        # the original model's scale: the short vectors approximate the full head_dim product
        self.attn = KVFoldAttentionLayer(dims.group, sum(dims.d_k), d**-0.5, num_kv_heads=1,
                                         head_size_v=sum(dims.d_v), cache_config=cache_config,
                                         per_layer_sliding_window=sliding_window, prefix=f"{prefix}.attn",
                                         attn_backend=KVFoldAttentionBackend, kvfold_dims=dims)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_full, self.k_full, sum(self.dims.d_v)], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        q = q @ getattr(self, Q_POST)  # [T, Σ_h d_k(g(h))]
        k = k @ getattr(self, K_POST)  # [T, Σ_g d_k]
        out = self.attn(q, k, v)  # [T, Σ_h d_v(g(h))]
        out, _ = self.o_proj(out)
        return out
