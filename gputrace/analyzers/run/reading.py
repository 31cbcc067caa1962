"""Reading a trace for the analysis: its frames, one per rank where the trace can be read
rank by rank, with the heap handed back between ranks; and whether analyzing it in worker
processes pays."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

from gputrace.analyzers.core import frame as fr
from gputrace.analyzers.extras.held import keep
from gputrace.trace.ranked import RankedTrace

_trim: Any = None     # glibc's malloc_trim, once looked up (False: none here)


def _give_back() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere),
    so that one rank's freed arrays do not stay in the process beside the next rank's."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


def _frames(trace: Any, consume: bool) -> Iterator[fr.Frame]:
    """The trace's frames: one per rank when it can be read rank by rank (RankedTrace),
    else one for the whole table."""
    if isinstance(trace, RankedTrace):
        ranked = any(r >= 0 for r in trace.groups)
        for r in trace.ranks:
            _give_back()
            cols = trace.columns(r, fr.COLUMNS)
            # unranked spans beside ranked ones belong to launchers (torchrun): dropped
            yield fr.build(cols, trace.metadata, drop_unranked=ranked and r < 0, others=keep)
            del cols
    elif consume:
        cols = {c: trace.table.column(c) for c in trace.table.column_names}
        trace.table = None
        yield fr.build(cols, trace.metadata, others=keep)
    else:
        yield fr.build(trace.table, trace.metadata, others=keep)



# below this many rows, a trace is analyzed in the calling process: starting workers
# (~0.5 s each on a 2-core machine) would cost more than they save
PARALLEL_MIN_ROWS = 2_000_000


def parallel_worth_it(trace: Any, jobs: int | None) -> bool:
    """Whether analyzing `trace` in worker processes pays: a RankedTrace of several ranks
    and, unless `jobs` was asked for, enough rows."""
    if not isinstance(trace, RankedTrace) or len(trace.groups) < 2:
        return False
    if jobs is not None:
        return jobs > 1
    return sum(trace.rows.values()) >= PARALLEL_MIN_ROWS
