"""The one exception the vLLM plugin raises for a model it cannot serve: its message is the fix."""

import logging

__all__ = ["KVFoldLoadError", "refuse"]

_log = logging.getLogger("kvfold_runtime.vllm")


class KVFoldLoadError(ValueError):
    """An export (or a setting) kvfold's vLLM plugin cannot serve; the message says what to do."""


def refuse(message: str) -> KVFoldLoadError:
    """The error to raise, also logged as one line: vLLM builds the model in its engine process and
    prints that process's traceback around the exception, so the log line is the one to read."""
    _log.error("kvfold: %s", message)
    return KVFoldLoadError(message)
