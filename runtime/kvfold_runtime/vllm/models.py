"""vLLM model classes for kvfold exports: vLLM's own Llama model with kvfold's attention module.

Llama, Mistral, Qwen2 and Qwen3 share one structure in vLLM and in their checkpoints (embed_tokens,
layers.N.{input_layernorm, self_attn, post_attention_layernorm, mlp}, norm, lm_head): each export
class is vLLM's LlamaForCausalLM built with `attn_layer_type=` kvfold's attention, which differs per
family only in its QKV/O biases and QK-norm. Every other KVFold<Arch> name that kvfold exports is
registered too, as a class that stops at load with one line naming what vLLM can serve.

Weights load through vLLM's loaders: q/k/v_proj stack into one fused projection (its three widths are
the full q and k and the compressed v), the post-RoPE tensors go through block-diagonal loaders. Rank- and
bits-format exports build the same model; a bits export's layers cache their band codes (one uint8 row of
LayerDims.row_bytes() per token, kvfold_runtime.vllm.attention.KVFoldAttentionLayer). Before any weight is
read, the model class checks the export (`_check`): its files, its kvfold block, its attention tensors'
shapes against the block's widths (safetensors headers only), and that a bits export's cache is not given
a kv_cache_dtype (its codes are not quantized again). A windowed bits export's model also holds the rings of its
layers' whole rows (kvfold_runtime.vllm.ring), and serves without prefix caching.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from torch import nn
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.utils import WeightsMapper

from kvfold_runtime.export import check_export, tensor_shapes
from kvfold_runtime.families import FAMILIES
from kvfold_runtime.format import (
    K_POST,
    K_SHIFT,
    Q_POST,
    ConfigBlock,
    LayerDims,
    head_dim,
    model_dims,
    runtime_class_name,
)
from kvfold_runtime.sharding import check_tensor_parallel
from kvfold_runtime.vllm.attention import KVFoldVllmAttention
from kvfold_runtime.vllm.errors import refuse
from kvfold_runtime.vllm.ring import RING_PREFIX, KVFoldRing, model_ring_plan

__all__ = ["SERVED"]


def _check(vllm_config) -> None:
    """Before any weight is read: the export's files (sha256 vs its manifest), its kvfold block, whether it
    splits over the tensor-parallel size, its tensors' shapes, and the cache dtype a bits-format export is
    served with."""
    model_config = vllm_config.model_config
    folder = Path(model_config.model)
    try:
        manifest = check_export(folder) if folder.is_dir() else {}
        dims = model_dims(model_config.hf_config)
        check_tensor_parallel(dims, vllm_config.parallel_config.tensor_parallel_size, manifest.get("tensor_parallel"))
    except ValueError as e:
        raise refuse(str(e)) from None
    block = ConfigBlock.from_config(model_config.hf_config)
    if block.windowed:
        _check_windowed(vllm_config, block)
    cache_dtype = vllm_config.cache_config.cache_dtype
    if any(d.banded for d in dims) and cache_dtype != "auto":
        raise refuse(f"a bits-format export's cache stores its band codes and scales as they are; "
                     f"kv_cache_dtype={cache_dtype!r} would quantize those bytes again: serve it with "
                     "kv_cache_dtype='auto' (drop --kv-cache-dtype)")
    if folder.is_dir():
        _check_shapes(folder, model_config.hf_config, dims)


def _check_windowed(vllm_config, block: ConfigBlock) -> None:
    """What a windowed bits export's rings (kvfold_runtime.vllm.ring) do not serve: a prefix-cache hit (it skips the
    tokens whose whole rows the request's ring would hold), speculative decoding (drafts written before they are
    accepted would overwrite window rows still read), pipeline stages."""
    kept = f"this export keeps each request's first {block.sinks} and last {block.window} tokens whole (windowed)"
    if vllm_config.cache_config.enable_prefix_caching:
        raise refuse(f"{kept}, which a prefix-cache hit would skip: serve it with --no-enable-prefix-caching "
                     "(enable_prefix_caching=False)")
    if vllm_config.speculative_config is not None:
        raise refuse(f"{kept}: speculative decoding is not supported with it; drop --speculative-config")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise refuse(f"{kept}: pipeline parallelism is not supported with it; drop --pipeline-parallel-size")


def _check_shapes(folder: Path, config, dims: list[LayerDims]) -> None:
    """Each layer's compressed tensors (stored [out, in]) have the widths of config.json's kvfold block — for a
    bits-format export the widths its band table (k_bits / v_bits) keeps."""
    shapes = tensor_shapes(folder)
    d, hidden = head_dim(config), config.hidden_size
    block = ConfigBlock.from_config(config)
    post_rope = block.post_rope_projections
    for i, layer in enumerate(dims):
        want = {"v_proj.weight": (sum(layer.d_v), hidden), "o_proj.weight": (hidden, layer.out_width)}
        if post_rope:
            want |= {K_POST: (d, sum(layer.d_k)), Q_POST: (d, layer.q_width)}
        if block.key_shift:
            want[K_SHIFT] = (d * layer.num_kv_heads,)
        for suffix, shape in want.items():
            name = f"model.layers.{i}.self_attn.{suffix}"
            if shapes.get(name) != shape:
                table = "band table (k_bits / v_bits)" if layer.banded else "ranks (d_k / d_v)"
                got = "is missing" if name not in shapes else f"has shape {list(shapes[name])}"
                raise refuse(f"{name} {got}, config.json's kvfold {table} gives {list(shape)}: the export is corrupt "
                             "or was edited; re-export the model (`kvfold verify` names every difference)")


# Compiled by vLLM like its own Llama (torch.compile; on CPU with inductor): the attention runs inside vLLM's
# opaque custom op (unified_attention_with_output), so compilation never traces kvfold's Python attention; the
# fused projections, RoPE, the post-RoPE projections, norms and MLP compile as the original's do.
class _KVFoldLlamaModel(LlamaModel):
    # vLLM's Llama maps q/k/v_proj onto QKVParallelLinear's named shards; kvfold's fused projection is a
    # MergedColumnParallelLinear (its v width is not a multiple of the head size), addressed by index.
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={
        ".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
        ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1),
    })


def _export_class(architecture: str, **attention_traits) -> type:
    attention = type(f"{runtime_class_name(architecture)}Attention", (KVFoldVllmAttention,), attention_traits)

    class Model(LlamaForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            _check(vllm_config)
            super().__init__(vllm_config=vllm_config, prefix=prefix,
                             layer_type=partial(LlamaDecoderLayer, attn_layer_type=attention))
            if (plan := model_ring_plan(vllm_config)) is not None:  # a windowed export's whole rows
                self.kvfold_rings = nn.ModuleList(KVFoldRing(plan, vllm_config.model_config.dtype,
                                                             f"{RING_PREFIX}.{j}") for j in range(plan.rings))

        def _init_model(self, vllm_config, prefix: str = "", layer_type=LlamaDecoderLayer):
            return _KVFoldLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    Model.__name__ = Model.__qualname__ = runtime_class_name(architecture)
    Model.__doc__ = f"A kvfold export of {architecture}: a KV cache of per-head compressed widths."
    return Model


def _traits(family) -> dict:
    """How the family's attention differs from vLLM's Llama attention (everything else is vLLM's Llama)."""
    biases = {"qkv_bias": True, "o_bias": False} if family.qkv_bias else {}  # Qwen2: q/k/v biased, o_proj not
    return biases | ({"qk_norm": True} if family.qk_norm else {})


SERVED = {arch: _traits(f) for arch, f in FAMILIES.items() if f.vllm}  # source architecture -> attention traits
_classes = {arch: _export_class(arch, **traits) for arch, traits in SERVED.items()}


def _unservable_class(architecture: str) -> type:
    served = ", ".join(runtime_class_name(a) for a in SERVED)

    class Unservable(_classes["LlamaForCausalLM"]):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            raise refuse(f"kvfold's vLLM plugin does not serve {runtime_class_name(architecture)} exports (it serves "
                         f"{served}); load this one with transformers: import kvfold_runtime, then "
                         "AutoModelForCausalLM.from_pretrained")

    Unservable.__name__ = Unservable.__qualname__ = runtime_class_name(architecture)
    return Unservable


for _arch in FAMILIES:
    if _arch not in _classes:
        _classes[_arch] = _unservable_class(_arch)


# ModelRegistry.register_model("KVFoldLlamaForCausalLM", "kvfold_runtime.vllm.models:KVFoldLlamaForCausalLM")
globals().update({runtime_class_name(arch): cls for arch, cls in _classes.items()})
