"""Progress of the long stages (calibration's batches, sensitivity probes, each candidate's scoring windows, the
pass keys, verify's texts and generations): a rich bar with its ETA on a terminal, plain timed lines elsewhere.

The library draws nothing by itself. Inside `shown_on(console)` (the CLI's stderr console, around each command's
work) a stage shows a bar when that console is a terminal (not a dumb one, not under CI). Otherwise — a pipe, CI,
or the library called as an API — a stage gets a line every EVERY seconds (`KVFOLD_PROGRESS_SECONDS`, default
10) and one at its end if it ran that long: on that console, or through the "kvfold" logger, silent unless
logging is configured. A stage inside another (a probe's windows inside the sensitivity probes) shares its
display and shows its own bar once it has run NESTED_AFTER seconds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["Advance", "progress", "shown_on"]

Advance = Callable[..., None]  # advance(n=1): n more steps of the stage done
NESTED_AFTER = 1.0  # seconds; shorter inner stages (one probe's windows) would only flicker
_log = logging.getLogger("kvfold")
_console: ContextVar[Console | None] = ContextVar("kvfold_progress_console", default=None)
_bars: ContextVar[Progress | None] = ContextVar("kvfold_progress_bars", default=None)


@contextmanager
def shown_on(console: Console) -> Iterator[None]:
    """Stages started inside report on `console`: bars when it is a terminal, else plain lines."""
    token = _console.set(console)
    try:
        yield
    finally:
        _console.reset(token)


def _terminal(console: Console | None) -> bool:
    return (console is not None and console.is_terminal and not console.is_dumb_terminal
            and not os.environ.get("CI"))


@contextmanager
def progress(description: str, total: int, unit: str = "") -> Iterator[Advance]:
    """One stage of `total` steps: yields `advance(n=1)` for the loop to call after each step."""
    console = _console.get()
    with (_bar if _terminal(console) else _lines)(console, description, total, unit) as advance:
        yield advance


@contextmanager
def _bar(console: Console, description: str, total: int, unit: str) -> Iterator[Advance]:
    bars, token = _bars.get(), None
    if bars is None:
        bars = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                        TextColumn("{task.completed}/{task.total} {task.fields[unit]}"), TimeElapsedColumn(),
                        TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True)
        bars.start()
        token = _bars.set(bars)
    task = bars.add_task(description, total=total, unit=unit, visible=token is not None)
    bars.refresh()
    started = time.monotonic()

    def advance(n: int = 1) -> None:
        visible = token is not None or time.monotonic() - started >= NESTED_AFTER
        bars.update(task, advance=n, visible=visible)

    try:
        yield advance
    finally:
        bars.remove_task(task)
        if token is not None:
            bars.stop()
            _bars.reset(token)


@contextmanager
def _lines(console: Console | None, description: str, total: int, unit: str) -> Iterator[Advance]:
    every = float(os.environ.get("KVFOLD_PROGRESS_SECONDS", "10"))
    started = last = time.monotonic()
    done, said = 0, False
    unit = f" {unit}" if unit else ""

    def say(line: str) -> None:
        if console is not None:
            console.print(line, markup=False, highlight=False)
        else:
            _log.info(line)

    def advance(n: int = 1) -> None:
        nonlocal done, last, said
        done += n
        now = time.monotonic()
        if now - last >= every and 0 < done < total:
            left = (now - started) / done * (total - done)
            say(f"{description}: {done}/{total}{unit}, {now - started:.0f} s, ~{left:.0f} s left")
            last, said = now, True

    yield advance
    elapsed = time.monotonic() - started
    if said or elapsed >= every:
        say(f"{description}: {done}/{total}{unit} in {elapsed:.0f} s")
