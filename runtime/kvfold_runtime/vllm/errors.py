"""The one exception the vLLM plugin raises for a model it cannot serve: its message is the fix."""

import logging

__all__ = ["KVFoldLoadError", "refuse"]

# A child of vLLM's "vllm" logger, so the line comes out in vLLM's format, in every vLLM process.
_log = logging.getLogger("vllm.kvfold")


class KVFoldLoadError(ValueError):
    """An export (or a setting) kvfold's vLLM plugin cannot serve; the message says what to do."""


def refuse(message: str) -> KVFoldLoadError:
    """The error to raise, also logged as one line: vLLM builds the model in its engine process and
    prints that process's traceback around the exception, so the log line is the one to read."""
    _log.error("kvfold: %s", message)
    return KVFoldLoadError(message)
