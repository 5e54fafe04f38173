"""The one exception users see: its message names the problem and the fix."""

__all__ = ["KVFoldError"]


class KVFoldError(Exception):
    """A problem with the user's input or environment. The CLI prints it as one red line, exit code 2."""
