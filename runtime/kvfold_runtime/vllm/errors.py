"""The one exception the vLLM plugin raises for a model it cannot serve: its message is the fix."""

__all__ = ["KVFoldLoadError"]


class KVFoldLoadError(ValueError):
    """An export (or a setting) kvfold's vLLM plugin cannot serve; the message says what to do."""
