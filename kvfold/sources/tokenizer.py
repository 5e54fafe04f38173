"""The model folder's tokenizer, or a clear error."""

from __future__ import annotations

from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["load_tokenizer"]


def load_tokenizer(path: Path, alternative: str = ""):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        raise KVFoldError(f"'{path}' has no usable tokenizer, which reading text needs; "
                          f"save one beside the model{alternative}") from None
