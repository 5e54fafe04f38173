"""The source architectures kvfold exports, as data — the one architecture table: where their attention
projections live and how their attention differs (RoPE or not, QK-norm, fused QKV, biases, where the score
scale is applied), and which ones vLLM serves.

kvfold's compiler adds, per row, only where the decoder layers are (kvfold.adapters); the runtime does not
import kvfold, so a serving machine needs only this package.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "Family"]


@dataclass(frozen=True)
class Family:
    architecture: str  # the source HF class, e.g. LlamaForCausalLM
    config: str  # its config class (importing it does not import the modeling code)
    module: str  # its modeling module, for the class and (RoPE models) apply_rotary_pos_emb
    attention: str  # the attention class whose instances are replaced
    rope: bool
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    qkv_fused: str | None = None  # GPT-2's c_attn: one Conv1D giving [q | k | v]
    conv1d: bool = False  # weights stored [in, out] (GPT-2)
    qk_norm: bool = False  # q_norm / k_norm over each head before RoPE (Qwen3, Gemma 3)
    prescale_q: bool = False  # OPT multiplies q by the scale right after q_proj, attention scale 1
    resid_dropout: bool = False  # GPT-2 applies it inside the attention module
    qkv_bias: bool = False  # q/k/v always carry biases, o_proj none (Qwen2); others: as their config says
    vllm: bool = False  # served by the vLLM plugin (vLLM's Llama model with kvfold's attention)


def _llama_like(arch: str, model: str, prefix: str, config: str = "", **kw) -> Family:
    return Family(arch, config or f"{prefix}Config", f"transformers.models.{model}.modeling_{model}",
                  f"{prefix}Attention", rope=True, **kw)


FAMILIES = {f.architecture: f for f in (
    _llama_like("LlamaForCausalLM", "llama", "Llama", vllm=True),
    _llama_like("MistralForCausalLM", "mistral", "Mistral", vllm=True),
    _llama_like("Qwen2ForCausalLM", "qwen2", "Qwen2", qkv_bias=True, vllm=True),
    _llama_like("Qwen3ForCausalLM", "qwen3", "Qwen3", qk_norm=True, vllm=True),
    _llama_like("Gemma2ForCausalLM", "gemma2", "Gemma2"),
    _llama_like("Gemma3ForCausalLM", "gemma3", "Gemma3", config="Gemma3TextConfig", qk_norm=True),
    Family("GPT2LMHeadModel", "GPT2Config", "transformers.models.gpt2.modeling_gpt2", "GPT2Attention", rope=False,
           o_proj="c_proj", qkv_fused="c_attn", conv1d=True, resid_dropout=True, qkv_bias=True),
    Family("OPTForCausalLM", "OPTConfig", "transformers.models.opt.modeling_opt", "OPTAttention", rope=False,
           o_proj="out_proj", prescale_q=True, qkv_bias=True),
)}
