"""Where the CLI writes: results to stdout, logs and errors to stderr; user errors as one red line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from kvfold.errors import KVFoldError

__all__ = ["err", "out", "user_errors"]

out = Console()
err = Console(stderr=True, soft_wrap=True, highlight=False)


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input and Ctrl-C end in one red line and exit code 2 (api writes outputs atomically)."""
    try:
        yield
    except KVFoldError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("[red]error:[/red] interrupted; no output was written")
        raise typer.Exit(2) from None
