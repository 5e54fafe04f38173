"""The attention module of a kvfold export inside vLLM (Llama-like RoPE families).

Per layer (row vectors; the same algebra as kvfold_runtime.hf.attention):
  q = RoPE(norm(x W_q)) A_h,  k' = RoPE(norm(x W_k)) B_g,  v' = x W_v',  out = Σ_h attn_h(q, k', v') W_O'^h
vLLM's own rotary embedding runs first; the post-RoPE projections A (`kvfold_q_post`, [d, Σ_h d_k(g(h))])
and B (`kvfold_k_post`, [d, Σ_g d_k]) are held one block per head ([H, d, widest] and [H_kv, d, widest],
narrower heads zero-padded), each applied as one batched product over vLLM's [T, H, d] query and key, then
packed to the heads' widths: a block-diagonal matmul did H times the work (SmolLM2: 9×, most of a decode
step's non-attention time outside the model's own matmuls). The weight loaders cut the checkpoint's compact
tensors into the blocks.

Tensor parallelism splits the layer by KV head (kvfold_runtime.sharding): each rank builds the attention of
its own heads — H/size query heads, H_kv/size KV heads, its share of v_proj's rows and o_proj's columns, its
heads' blocks of the post-RoPE projections — at the widest rank's widths (a lighter rank's last head padded
with zero dims), because vLLM wants one KV cache spec per layer on every rank. Everything outside attention
(embeddings, MLP, norms, lm_head; pipeline stages) is vLLM's Llama's own sharding.

The layer's `Attention` declares one KV head of width Σd_k / Σd_v and `group` query heads of width Σd_k
(see kvfold_runtime.vllm.backend): the packed vectors pass through vLLM's reshapes unchanged. It is vLLM's
Attention except for the KV cache spec of a bits-format layer (KVFoldAttentionLayer): a page of uint8 rows of
the layer's band codes and scales, LayerDims.row_bytes() per token. A windowed bits export's layers also read and
write their whole rows in rings (kvfold_runtime.vllm.ring), which the model class creates.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import KVQuantMode

from kvfold_runtime.format import K_POST, K_SHIFT, Q_POST, ConfigBlock, LayerDims, head_dim, model_dims
from kvfold_runtime.sharding import LayerShard, post_rope, shard_layer
from kvfold_runtime.vllm.backend import KVFoldAttentionBackend
from kvfold_runtime.vllm.errors import refuse
from kvfold_runtime.vllm.ring import model_ring_plan

__all__ = ["KVFoldAttentionLayer", "KVFoldVllmAttention"]


def _post_rope_loader(head_dim: int, width: int, take):
    """Weight loader of a post-RoPE projection: the checkpoint's [d, Σ widths] -> this rank's block-diagonal
    tensor (`take`, a LayerShard method)."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (head_dim, width):
            raise refuse(f"post-RoPE projection has shape {tuple(loaded.shape)}, expected {(head_dim, width)} from "
                         "config.json's ranks: the export is corrupt; run `kvfold verify` on it")
        param.data.copy_(take(loaded))

    return load


def _key_shift_loader(full: int, heads: range, head_dim: int):
    """Weight loader of the key shift: the checkpoint's [H_kv · d] -> this rank's KV heads' [local H_kv · d]."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (full,):
            raise refuse(f"key shift has shape {tuple(loaded.shape)}, expected {(full,)}: the export is corrupt; "
                         "run `kvfold verify` on it")
        param.data.copy_(loaded[heads.start * head_dim:heads.stop * head_dim])

    return load


class _PackedQKV(MergedColumnParallelLinear):
    """x -> [q | k | v'] in one matmul. q and k (full heads) split over tensor-parallel ranks as vLLM splits its
    own; v' (the values at per-head widths) takes this rank's heads (LayerShard.v_rows, padded to the widest
    rank), so its third output is declared as size × the rank's (padded) value width."""

    def __init__(self, hidden: int, q_full: int, k_full: int, shard: LayerShard, size: int, bias: bool,
                 prefix: str) -> None:
        super().__init__(hidden, [q_full, k_full, size * sum(shard.dims.d_v)], bias=bias, prefix=prefix)
        self.kvfold_shard, self.kvfold_v_start = shard, (q_full + k_full) // size

    def _load_v(self, param, loaded: torch.Tensor) -> None:
        rows = self.kvfold_shard.v_rows(loaded)
        param.data[self.kvfold_v_start:self.kvfold_v_start + rows.shape[0]].copy_(rows)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):  # biases
        if loaded_shard_id == 2:
            return self._load_v(param, loaded_weight)
        return super().weight_loader(param, loaded_weight, loaded_shard_id)

    def weight_loader_v2(self, param, loaded_weight, loaded_shard_id=None):  # weights
        if loaded_shard_id == 2:
            return self._load_v(param, loaded_weight)
        return super().weight_loader_v2(param, loaded_weight, loaded_shard_id)


class _PackedOut(RowParallelLinear):
    """o_proj over the packed attention output: this rank's query heads' columns (LayerShard.o_cols); vLLM adds
    the ranks' partial products (and the bias once)."""

    def __init__(self, shard: LayerShard, size: int, hidden: int, bias: bool, prefix: str) -> None:
        super().__init__(size * shard.dims.out_width, hidden, bias=bias, prefix=prefix)
        self.kvfold_shard = shard

    def weight_loader_v2(self, param, loaded_weight):  # the weight
        param.data.copy_(self.kvfold_shard.o_cols(loaded_weight))

    def weight_loader(self, param, loaded_weight):  # the bias (whole on every rank), or the weight
        if loaded_weight.dim() == 2:
            return self.weight_loader_v2(param, loaded_weight)
        return super().weight_loader(param, loaded_weight)


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
        if quant_config is not None:
            raise refuse("kvfold exports are unquantized checkpoints; drop --quantization")
        layer = extract_layer_index(prefix)
        # checked by the model class before any layer is built (sizes that do not split are refused there)
        size, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        shard = shard_layer(model_dims(config)[layer], rank, size)
        self.dims = dims = shard.dims  # this rank's KV heads, the last widened to the widest rank's widths
        self.head_dim = d = head_dim(config)
        self.q_full, self.k_full = num_heads * d // size, num_kv_heads * d // size  # this rank's
        qkv_bias = bias if self.qkv_bias is None else self.qkv_bias
        self.qkv_proj = _PackedQKV(hidden_size, num_heads * d, num_kv_heads * d, shard, size, qkv_bias,
                                   prefix=f"{prefix}.qkv_proj")
        o_bias = bias_o_proj if self.o_bias is None else self.o_bias
        self.o_proj = _PackedOut(shard, size, hidden_size, o_bias, prefix=f"{prefix}.o_proj")
        if self.qk_norm:
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(d, max_position=max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None), is_neox_style=True)
        # one block per head of this rank: a batched product on vLLM's [T, heads, d] queries and keys
        for name, heads, widths, width, take, columns in (
                (Q_POST, self.q_full // d, [w for w in dims.d_k for _ in range(dims.group)], shard.source.q_width,
                 shard.q_post, shard.q_post_columns()),
                (K_POST, self.k_full // d, list(dims.d_k), sum(shard.source.d_k), shard.k_post,
                 shard.k_post_columns())):
            post = nn.Parameter(torch.zeros(heads, d, max(widths)), requires_grad=False)
            post.weight_loader = _post_rope_loader(d, width, take)
            self.register_parameter(name, post)
            self.register_buffer(f"{name}_columns", columns, persistent=False)
        self.key_shift = ConfigBlock.from_config(config).key_shift
        if self.key_shift:  # subtracted from the post-RoPE keys: a constant softmax does not see (format.py)
            shift = nn.Parameter(torch.zeros(self.k_full), requires_grad=False)
            shift.weight_loader = _key_shift_loader(num_kv_heads * d, shard.heads, d)
            self.register_parameter(K_SHIFT, shift)
        sliding_window = None
        if (types := getattr(config, "layer_types", None)) and types[layer] == "sliding_attention":
            sliding_window = config.sliding_window
        # the original model's scale: the short vectors approximate the full head_dim product
        # a windowed bits export: where this layer's whole rows live (kvfold_runtime.vllm.ring)
        plan = model_ring_plan(get_current_vllm_config())
        ring = None if plan is None else (*plan.place(layer), plan.sinks, plan.window)
        self.attn = KVFoldAttentionLayer(dims.group, sum(dims.d_k), d**-0.5, num_kv_heads=1,
                                         head_size_v=sum(dims.d_v), cache_config=cache_config,
                                         per_layer_sliding_window=sliding_window, prefix=f"{prefix}.attn",
                                         attn_backend=KVFoldAttentionBackend, kvfold_dims=dims, kvfold_ring=ring)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_full, self.k_full, sum(self.dims.d_v)], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        # vLLM's CPU rotary kernel stores 8 bfloat16 at a time with aligned stores: rows of q and k inside a qkv
        # row whose width is not a multiple of 8 (kvfold's value widths are free) crash it, so RoPE gets its own
        # contiguous rows (a copy of T × (q + k) numbers, small beside the projections)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        if self.key_shift:
            k = k - getattr(self, K_SHIFT)
        q = post_rope(q, getattr(self, Q_POST), getattr(self, f"{Q_POST}_columns"))  # [T, Σ_h d_k(g(h))]
        k = post_rope(k, getattr(self, K_POST), getattr(self, f"{K_POST}_columns"))  # [T, Σ_g d_k]
        out = self.attn(q, k, v)  # [T, Σ_h d_v(g(h))]
        out, _ = self.o_proj(out)
        return out
