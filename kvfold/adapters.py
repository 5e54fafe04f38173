"""Architectures as data: the runtime's table (kvfold_runtime.FAMILIES: projections, RoPE, QK-norm, fused QKV,
biases) plus what only the compiler needs: where the decoder layers and their attention modules live.

One `Adapter` per `config.architectures[0]`. Adding an architecture = one row in the runtime's FAMILIES, one
here, and one in the tests' tiny-model matrix. An unknown architecture is an error, never a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from kvfold.errors import KVFoldError
from kvfold_runtime import FAMILIES, Family, head_dim

__all__ = ["ADAPTERS", "Adapter", "HeadLayout", "get_adapter"]


@dataclass(frozen=True)
class Adapter:
    family: Family  # the runtime's row: what the exported model's attention looks like
    name: str  # family name written into artifacts
    layers: str = "model.layers"  # dotted path from the CausalLM to the list of decoder layers
    attention: str = "self_attn"  # attribute of a decoder layer holding its attention module

    # The family's fields, as the compiler reads them.
    @property
    def q_proj(self) -> str | None:  # projections inside the attention module (None when fused)
        return None if self.family.qkv_fused else self.family.q_proj

    @property
    def k_proj(self) -> str | None:
        return None if self.family.qkv_fused else self.family.k_proj

    @property
    def v_proj(self) -> str | None:
        return None if self.family.qkv_fused else self.family.v_proj

    @property
    def o_proj(self) -> str:
        return self.family.o_proj

    @property
    def qkv_fused(self) -> str | None:  # one module producing [q | k | v] (GPT-2's c_attn)
        return self.family.qkv_fused

    @property
    def proj_layout(self) -> Literal["linear", "conv1d"]:  # conv1d weights are [in, out] (GPT-2)
        return "conv1d" if self.family.conv1d else "linear"

    @property
    def rope(self) -> bool:  # RoPE models get post-RoPE projections; others fold Q/K into the weights
        return self.family.rope

    @property
    def qk_norm(self) -> bool:  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma3)
        return self.family.qk_norm

    @property
    def qkv_bias(self) -> bool:  # q/k/v projections always carry biases (Llama/Mistral: only if configured)
        return self.family.qkv_bias

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
        return cls(config.num_hidden_layers, heads, kv_heads, head_dim(config))


# architecture -> (family name, where its decoder layers are, their attention attribute)
_WHERE = {
    "LlamaForCausalLM": ("llama",),
    "MistralForCausalLM": ("mistral",),
    "Qwen2ForCausalLM": ("qwen2",),
    "Qwen3ForCausalLM": ("qwen3",),
    "Gemma2ForCausalLM": ("gemma2",),
    "Gemma3ForCausalLM": ("gemma3",),
    "GPT2LMHeadModel": ("gpt2", "transformer.h", "attn"),
    "OPTForCausalLM": ("opt", "model.decoder.layers"),
}
ADAPTERS: dict[str, Adapter] = {arch: Adapter(FAMILIES[arch], *where) for arch, where in _WHERE.items()}


def get_adapter(architecture: str) -> Adapter:
    try:
        return ADAPTERS[architecture]
    except KeyError:
        supported = ", ".join(sorted(ADAPTERS))
        raise KVFoldError(
            f"unsupported architecture '{architecture}'; kvfold supports: {supported}"
        ) from None
