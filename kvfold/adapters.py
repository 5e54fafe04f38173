"""Architectures as data: where each supported HF architecture keeps its attention projections.

One `Adapter` per `config.architectures[0]`. Adding an architecture = one registry entry + one row in
the tests' tiny-model matrix. An unknown architecture is an error, never a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from kvfold.errors import KVFoldError

__all__ = ["ADAPTERS", "Adapter", "HeadLayout", "get_adapter"]


@dataclass(frozen=True)
class Adapter:
    name: str  # family name written into artifacts
    layers: str  # dotted path from the CausalLM to the list of decoder layers
    attention: str  # attribute of a decoder layer holding its attention module
    q_proj: str | None  # projections inside the attention module (None when fused)
    k_proj: str | None
    v_proj: str | None
    o_proj: str
    qkv_fused: str | None = None  # one module producing [q | k | v] (GPT-2's c_attn)
    proj_layout: Literal["linear", "conv1d"] = "linear"  # conv1d weights are [in, out] (GPT-2)
    rope: bool = True  # RoPE models get post-RoPE projections; others fold Q/K into the weights
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma3)
    qkv_bias: bool = False  # q/k/v projections always carry biases (Llama/Mistral: only if configured)
    sliding_window: bool = False  # some or all layers may attend to a window only

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        mod = model
        for part in self.layers.split("."):
            mod = getattr(mod, part)
        return list(mod)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [getattr(layer, self.attention) for layer in self.decoder_layers(model)]


@dataclass(frozen=True)
class HeadLayout:
    """Head counts as the config states them (GPT-2 names them differently; HF maps the names)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> HeadLayout:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, heads, kv_heads, head_dim)


_LLAMA = dict(layers="model.layers", attention="self_attn", q_proj="q_proj", k_proj="k_proj",
              v_proj="v_proj", o_proj="o_proj")

ADAPTERS: dict[str, Adapter] = {
    "LlamaForCausalLM": Adapter(name="llama", **_LLAMA),
    "MistralForCausalLM": Adapter(name="mistral", sliding_window=True, **_LLAMA),
    "Qwen2ForCausalLM": Adapter(name="qwen2", qkv_bias=True, sliding_window=True, **_LLAMA),
    "Qwen3ForCausalLM": Adapter(name="qwen3", qk_norm=True, sliding_window=True, **_LLAMA),
    "Gemma2ForCausalLM": Adapter(name="gemma2", sliding_window=True, **_LLAMA),
    "Gemma3ForCausalLM": Adapter(name="gemma3", qk_norm=True, sliding_window=True, **_LLAMA),
    "GPT2LMHeadModel": Adapter(
        name="gpt2", layers="transformer.h", attention="attn", q_proj=None, k_proj=None, v_proj=None,
        o_proj="c_proj", qkv_fused="c_attn", proj_layout="conv1d", rope=False, qkv_bias=True,
    ),
    "OPTForCausalLM": Adapter(
        name="opt", layers="model.decoder.layers", attention="self_attn", q_proj="q_proj",
        k_proj="k_proj", v_proj="v_proj", o_proj="out_proj", rope=False, qkv_bias=True,
    ),
}


def get_adapter(architecture: str) -> Adapter:
    try:
        return ADAPTERS[architecture]
    except KeyError:
        supported = ", ".join(sorted(ADAPTERS))
        raise KVFoldError(
            f"unsupported architecture '{architecture}'; kvfold supports: {supported}"
        ) from None
