"""Where the CLI writes: results to stdout, logs and errors to stderr; user errors as one red line."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from kvfold.errors import KVFoldError
from kvfold.progress import shown_on

__all__ = ["err", "out", "user_errors"]

out = Console()
err = Console(stderr=True, soft_wrap=True, highlight=False)


def _interrupt(signum, frame):
    # Python runs this handler wherever the main thread is; if that is inside an object's __del__ (the
    # garbage collector runs them at any moment — regex's Group objects have one), the KeyboardInterrupt
    # is printed as "Exception ignored" and lost, and the run goes on. So ask again shortly until one lands.
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    raise KeyboardInterrupt


@contextmanager
def _reliable_ctrl_c() -> Iterator[None]:
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # ignored (nohup, `cmd &`): keep that
        yield
        return
    previous, hook = signal.signal(signal.SIGALRM, _interrupt), sys.unraisablehook

    def quiet(unraisable):  # the lost interrupt is asked for again: no "Exception ignored" trace for it
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            hook(unraisable)

    sys.unraisablehook = quiet
    signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = hook


def _quiet_libraries() -> None:
    """transformers' own progress bars and warnings would bury ours (imported here, when work starts)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@contextmanager
def user_errors() -> Iterator[None]:
    """Where a command's work runs: bad input and Ctrl-C end in one red line and exit code 2 (api writes
    outputs atomically). Long stages show their progress on stderr (kvfold/progress.py)."""
    _quiet_libraries()
    try:
        with _reliable_ctrl_c(), shown_on(err):
            yield
    except KVFoldError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("[red]error:[/red] interrupted; no output was written")
        raise typer.Exit(2) from None
