"""KVFold<Arch> model classes and their registration with transformers' Auto classes.

Each class is its source class (e.g. LlamaForCausalLM) with every attention module replaced by
KVFoldAttention at the widths in config.json's `kvfold` block. An export keeps `model_type` (so any
tool that reads configs still understands it) and names `KVFold<Arch>` in `architectures`.

Registration uses the two public calls of transformers' "Extending the Auto Classes" docs only:
`AutoConfig.register(model_type, config_class)` and `AutoModelForCausalLM.register(config_class,
model_class)`. The Auto model mapping of a config class that transformers itself defines cannot be
changed through them (transformers 5.17 skips every such registration without a word; 5.19 skips it
unless exist_ok), so exports get a config class of their own: KVFold<Config>, a subclass of the source
config with the same `model_type`, registered with AutoConfig for that `model_type`. Calling it builds
a KVFold<Config> only when `architectures` names the KVFold class and the plain source config
otherwise (ExportConfigMeta), so plain checkpoints, `AutoConfig.for_model` and sub-configs of
composite models get exactly the class they got before. AutoModelForCausalLM maps KVFold<Config> to a
small dispatcher that loads the KVFold class when `architectures` names it and the source class
otherwise (a caller may point an export config at the source class, as kvfold's reference loader
does). Plain config classes keep transformers' own mapping: `AutoModelForCausalLM.from_config(
LlamaConfig())` is untouched.

Classes are built on first use: `import kvfold_runtime` imports config classes only, no modeling code.
"""

from __future__ import annotations

import functools
import importlib

import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from kvfold_runtime.families import FAMILIES, Family
from kvfold_runtime.format import ConfigBlock, head_dim, model_dims, runtime_class_name
from kvfold_runtime.hf.attention import KVFoldAttention

__all__ = ["export_config_class", "register", "runtime_class"]


def _compress_attention(model, family: Family) -> None:
    attention_cls = getattr(importlib.import_module(family.module), family.attention)
    dims, d = model_dims(model.config), head_dim(model.config)
    block = ConfigBlock.from_config(model.config)
    shift, window = block.key_shift, (block.sinks, block.window)
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, attention_cls):
                setattr(parent, name, KVFoldAttention(child, family, dims[child.layer_idx], d, shift, window))
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


class ExportConfigMeta(type):
    """The metaclass of KVFold<Config>: a call builds the source config unless `architectures` names
    the KVFold class. Copies and unpickling go through `__new__`, so they keep the class they copy."""

    def __call__(cls, *args, **kwargs):
        if runtime_class_name(cls.kvfold_architecture) in (kwargs.get("architectures") or ()):
            return super().__call__(*args, **kwargs)
        return cls.__base__(*args, **kwargs)


@functools.cache
def export_config_class(architecture: str) -> type:
    """KVFold<Config>: the config class of exports of `architecture` (a source class name)."""
    family = FAMILIES[architecture]
    base = getattr(transformers, family.config)
    name = runtime_class_name(family.config)
    return ExportConfigMeta(name, (base,), {
        "__module__": __name__, "__qualname__": name, "kvfold_architecture": architecture,
        "__doc__": f"{family.config} of a kvfold export of {architecture} (same model_type, same fields)."})


def __getattr__(name: str) -> type:
    """KVFold<Config> by name, so pickle (vLLM sends configs to its workers) finds the classes."""
    for arch, family in FAMILIES.items():
        if name == runtime_class_name(family.config):
            return export_config_class(arch)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dispatcher(family: Family) -> type:
    runtime_name = runtime_class_name(family.architecture)

    def pick(config) -> type:
        if runtime_name in (getattr(config, "architectures", None) or ()):
            return runtime_class(family.architecture)
        return getattr(importlib.import_module(family.module), family.architecture)

    class AutoDispatch:
        config_class = export_config_class(family.architecture)
        kvfold_family = family

        # The hook AutoModelForCausalLM.from_config calls on a registered class.
        @classmethod
        def _from_config(cls, config, **kwargs):
            return pick(config)._from_config(config, **kwargs)

        @classmethod
        def from_pretrained(cls, path, *args, config=None, **kwargs):
            return pick(config).from_pretrained(path, *args, config=config, **kwargs)

    AutoDispatch.__name__ = AutoDispatch.__qualname__ = f"{family.architecture}Or{runtime_name}"
    return AutoDispatch


_registered: set[str] = set()


def register() -> None:
    """Let AutoConfig and AutoModelForCausalLM load exports of every supported architecture. Idempotent."""
    for arch, family in FAMILIES.items():
        if arch not in _registered:
            config_class = export_config_class(arch)
            AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
            AutoModelForCausalLM.register(config_class, _dispatcher(family), exist_ok=True)
            _registered.add(arch)
