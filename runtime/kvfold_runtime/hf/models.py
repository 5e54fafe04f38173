"""KVFold<Arch> model classes and their registration with transformers' Auto classes.

Each class is its source class (e.g. LlamaForCausalLM) with every attention module replaced by
KVFoldAttention at the widths in config.json's `kvfold` block. An export keeps `model_type` (so any
tool that reads configs still understands it) and names `KVFold<Arch>` in `architectures`. The Auto
mapping of the source config class gets a small dispatcher that loads the KVFold class when
`architectures` names it and the source class otherwise, so plain checkpoints load as before.
(transformers' own tuple-valued mappings would do the same but fail on configs whose `architectures`
is None, e.g. `AutoModelForCausalLM.from_config(LlamaConfig())`.)

Classes are built on first use: `import kvfold_runtime` imports config classes only, no modeling code.
"""

from __future__ import annotations

import functools
import importlib

import transformers
from transformers import AutoModelForCausalLM

from kvfold_runtime.dims import model_dims
from kvfold_runtime.hf.attention import KVFoldAttention
from kvfold_runtime.hf.families import FAMILIES, Family

__all__ = ["register", "runtime_class", "runtime_class_name"]


def runtime_class_name(architecture: str) -> str:
    return f"KVFold{architecture}"


def _compress_attention(model, family: Family) -> None:
    attention_cls = getattr(importlib.import_module(family.module), family.attention)
    dims = model_dims(model.config)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, attention_cls):
                setattr(parent, name, KVFoldAttention(child, family, dims[child.layer_idx], head_dim))
                found += 1
    assert found == len(dims), f"{family.attention}: found {found} attention modules, config lists {len(dims)}"


@functools.cache
def runtime_class(architecture: str) -> type:
    """The KVFold class serving exports of `architecture` (a source class name, e.g. LlamaForCausalLM)."""
    if architecture not in FAMILIES:
        raise ValueError(f"kvfold-runtime does not serve {architecture}; supported: {', '.join(sorted(FAMILIES))}")
    family = FAMILIES[architecture]
    base = getattr(importlib.import_module(family.module), family.architecture)

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        _compress_attention(self, family)

    name = runtime_class_name(architecture)
    return type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name,
                                "__doc__": f"{architecture} with a compressed KV cache (kvfold export)."})


def _dispatcher(family: Family, config_class: type) -> type:
    runtime_name = runtime_class_name(family.architecture)

    def pick(config) -> type:
        if runtime_name in (getattr(config, "architectures", None) or ()):
            return runtime_class(family.architecture)
        return getattr(importlib.import_module(family.module), family.architecture)

    class AutoDispatch:
        config_class = None  # set below
        kvfold_family = family

        @classmethod
        def _from_config(cls, config, **kwargs):
            return pick(config)._from_config(config, **kwargs)

        @classmethod
        def from_pretrained(cls, path, *args, config=None, **kwargs):
            return pick(config).from_pretrained(path, *args, config=config, **kwargs)

    AutoDispatch.config_class = config_class
    AutoDispatch.__name__ = AutoDispatch.__qualname__ = f"{family.architecture}Or{runtime_name}"
    return AutoDispatch


_registered: set[str] = set()


def register() -> None:
    """Let AutoModelForCausalLM load exports of every supported architecture. Idempotent."""
    for arch, family in FAMILIES.items():
        if arch not in _registered:
            config_class = getattr(transformers, family.config)
            AutoModelForCausalLM._model_mapping.register(config_class, _dispatcher(family, config_class),
                                                         exist_ok=True)
            _registered.add(arch)
