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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_heap: Any = None    # glibc's (malloc_trim, mallinfo2 or None), once looked up; False: none
# free heap bytes kept for the next rank's arrays rather than handed back to the OS: pages
# handed back are faulted in again, zeroed, when the next rank's arrays reuse them (with
# glibc's defaults, every array over 128 KiB mapped on its own and each rank's heap trimmed,
# 1e8 events over 1024 ranks took 59 s with -j 2, 1.5 million page faults a 1e7 run; with
# 64 MiB kept and arrays on the heap, 33 s and the same peak memory: bench/README.md)
KEEP_FREE = 64 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def _give_back() -> None:
    """Between ranks: hand the heap's free pages beyond KEEP_FREE back to the OS (glibc's
    malloc_trim; a no-op elsewhere), so that one rank's freed arrays do not stay in the
    process beside the next rank's. From the first call on, arrays up to 32 MiB come from
    the heap rather than each from a mapping of its own, and only this trims the heap, until
    `release`."""
    global _heap
    if _heap is None:
        try:
            libc = ctypes.CDLL(None)
            trim = libc.malloc_trim
            info = getattr(libc, "mallinfo2", None)    # glibc 2.33 on
            if info is not None:
                info.restype = _MallInfo2
                libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
                libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
            _heap = (trim, info, libc)
        except (OSError, AttributeError):
            _heap = False
    if _heap and (_heap[1] is None or _heap[1]().fordblks > KEEP_FREE):
        _heap[0](0)


def release() -> None:
    """After the last rank: the free heap kept for the next rank handed back (at 1e7 events
    over 256 ranks, ~25 MiB that stayed beside the combining of the ranks' parts and the
    document), and glibc's own thresholds (128 KiB) set again, for the process that called
    the analysis (a notebook's, through gputrace.analyze) as for the command's."""
    global _heap
    if _heap:
        if _heap[1] is not None:
            _heap[2].mallopt(M_MMAP_THRESHOLD, 128 << 10)
            _heap[2].mallopt(M_TRIM_THRESHOLD, 128 << 10)
        _heap[0](0)
        _heap = None


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
