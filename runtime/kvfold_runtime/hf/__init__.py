"""transformers integration: KVFold<Arch> classes for exported checkpoints."""

from kvfold_runtime.hf.models import register, runtime_class

__all__ = ["register", "runtime_class"]
