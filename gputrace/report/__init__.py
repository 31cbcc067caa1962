"""Renderers: terminal (rich), JSON; exporters: Perfetto/Chrome JSON."""

from __future__ import annotations

from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

# the width of a report that is not written to a terminal: no line is wrapped
_UNWRAPPED = 10_000


def console(file: IO[str] | None = None, width: int | None = None,
            stderr: bool = False) -> Console:
    """A rich Console for a report: on a terminal, the terminal's width; written to a file
    or a pipe, lines are not wrapped (a `width` given is kept either way)."""
    from rich.console import Console

    con = Console(file=file, width=width, stderr=stderr, highlight=False)
    if width is None and not con.is_terminal:
        con = Console(file=file, width=_UNWRAPPED, stderr=stderr, highlight=False,
                      soft_wrap=True)
    return con
