"""transformers integration: KVFold<Arch> classes for exported checkpoints."""

from kvfold_runtime.hf.models import RUNTIME_CLASSES, register, runtime_class_name

__all__ = ["RUNTIME_CLASSES", "register", "runtime_class_name"]
