"""The one door from kvfold to kvfold-runtime: its public top-level module, imported on demand."""

from __future__ import annotations

from types import ModuleType

from kvfold.errors import KVFoldError

__all__ = ["require_runtime"]


def require_runtime() -> ModuleType:
    """`kvfold_runtime` (importing it registers the KVFold classes with transformers' Auto classes)."""
    try:
        import kvfold_runtime
    except ImportError:
        raise KVFoldError("kvfold verify needs kvfold-runtime: pip install -e runtime/ "
                          "(scripts/setup.sh installs it)") from None
    return kvfold_runtime
