"""Progress bars for long work (analysis of many ranks, imports, the merge at the end of a
recording, reports), drawn with rich on the terminal only.

A command opens the bar for its whole run (`shown`); the code doing the work only says how
far it is (`each`, `update`), which costs nothing when no bar is shown: with stdout or stderr
not a terminal (piped, redirected, a notebook), with `--json`, with GPUTRACE_PROGRESS=0 or
TERM=dumb. Bars are drawn on stderr and cleared when the work ends, so nothing of them stays
in what a command prints. Work that is over within DELAY_S (GPUTRACE_PROGRESS_DELAY seconds
when set) draws none.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

DELAY_S = 0.5      # no bar for work that is over sooner

_current: contextvars.ContextVar[_Bars | None] = contextvars.ContextVar("gputrace_progress",
                                                                        default=None)


def on_terminal() -> bool:
    """Whether bars can be drawn: stdout and stderr are terminals and nobody said no."""
    if os.environ.get("GPUTRACE_PROGRESS", "").strip().lower() in ("0", "no", "off", "false"):
        return False
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return sys.stderr.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):   # closed or replaced streams
        return False


class _Bars:
    """One rich Progress on stderr; a task per kind of work, by its description."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            SpinnerColumn(), TextColumn("[progress.description]{task.description}"),
            BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            console=Console(file=sys.stderr), transient=True, redirect_stdout=False,
            redirect_stderr=False)
        self._tasks: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._started = False
        try:
            self._delay = float(os.environ.get("GPUTRACE_PROGRESS_DELAY", DELAY_S))
        except ValueError:
            self._delay = DELAY_S

    def __enter__(self) -> _Bars:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._started:
            self._progress.stop()

    def update(self, what: str, done: float, total: float | None) -> None:
        with self._lock:
            if not self._started:
                if time.monotonic() - self._t0 < self._delay:
                    return      # drawn once the work has lasted the delay
                self._progress.start()
                self._started = True
            task = self._tasks.get(what)
            if task is None:
                task = self._tasks[what] = self._progress.add_task(what, total=total)
            self._progress.update(task, completed=done, total=total)


@contextlib.contextmanager
def shown(enabled: bool | None = True) -> Iterator[bool]:
    """Draw the bars of the work done inside (when `enabled` and on a terminal; None: on a
    terminal). Yields whether they are drawn. A failure to draw never stops the work."""
    if enabled is False or _current.get() is not None or not on_terminal():
        yield False
        return
    try:
        bars = _Bars().__enter__()
    except Exception:  # noqa: BLE001 - no bar is no reason to stop
        yield False
        return
    token = _current.set(bars)
    try:
        yield True
    finally:
        _current.reset(token)
        with contextlib.suppress(Exception):
            bars.__exit__(None, None, None)


def active() -> bool:
    return _current.get() is not None


def update(what: str, done: float, total: float | None = None) -> None:
    """Say how far `what` is (`done` of `total`); nothing when no bar is shown."""
    bars = _current.get()
    if bars is not None:
        with contextlib.suppress(Exception):
            bars.update(what, done, total)


def each(items: Iterable[T], what: str, total: int | None = None) -> Iterator[T]:
    """The items, one at a time; the bar for `what` moves on as each is done with (when the
    next is asked for)."""
    if _current.get() is None:
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    update(what, 0, total)
    n = 0
    for item in items:
        yield item
        n += 1
        update(what, n, total)
