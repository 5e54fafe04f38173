"""KVFold<Arch> model classes and their registration with transformers' Auto classes.

Each class is its source class (e.g. LlamaForCausalLM) with every attention module replaced by
KVFoldAttention at the widths in config.json's `kvfold` block. An export keeps `model_type` (so any
tool that reads configs still understands it) and names `KVFold<Arch>` in `architectures`. The Auto
mapping of the source config class gets a small dispatcher that loads the KVFold class when
`architectures` names it and the source class otherwise, so plain checkpoints load as before.
(transformers' own tuple-valued mappings would do the same but fail on configs whose `architectures`
is None, e.g. `AutoModelForCausalLM.from_config(LlamaConfig())`.)
"""

from __future__ import annotations

import importlib

from transformers import AutoModelForCausalLM

from kvfold_runtime.dims import model_dims
from kvfold_runtime.hf.attention import KVFoldAttention
from kvfold_runtime.hf.families import FAMILIES, Family

__all__ = ["RUNTIME_CLASSES", "register", "runtime_class_name"]


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


def _make_class(family: Family) -> type:
    base = getattr(importlib.import_module(family.module), family.architecture)

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        _compress_attention(self, family)

    name = runtime_class_name(family.architecture)
    return type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name,
                                "__doc__": f"{family.architecture} with a compressed KV cache (kvfold export)."})


RUNTIME_CLASSES = {runtime_class_name(arch): _make_class(f) for arch, f in FAMILIES.items()}
globals().update(RUNTIME_CLASSES)  # importable by name, e.g. kvfold_runtime.hf.models.KVFoldLlamaForCausalLM


def _dispatcher(source: type, runtime: type) -> type:
    def pick(config) -> type:
        return runtime if runtime.__name__ in (getattr(config, "architectures", None) or ()) else source

    class AutoDispatch:
        config_class = source.config_class
        kvfold_classes = (source, runtime)

        @classmethod
        def _from_config(cls, config, **kwargs):
            return pick(config)._from_config(config, **kwargs)

        @classmethod
        def from_pretrained(cls, path, *args, config=None, **kwargs):
            return pick(config).from_pretrained(path, *args, config=config, **kwargs)

    AutoDispatch.__name__ = AutoDispatch.__qualname__ = f"{source.__name__}Or{runtime.__name__}"
    return AutoDispatch


def register() -> None:
    """Let AutoModelForCausalLM load exports of every supported architecture. Idempotent."""
    mapping = AutoModelForCausalLM._model_mapping
    for cls in RUNTIME_CLASSES.values():
        source = cls.__mro__[1]
        if getattr(mapping[source.config_class], "kvfold_classes", None) is None:
            mapping.register(source.config_class, _dispatcher(source, cls), exist_ok=True)
