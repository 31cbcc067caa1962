"""Reading what an analysis takes: a trace, several, a directory of shards, the name of a
multi-node recording, a glob, Kineto JSON or Nsight Systems SQLite."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gputrace.fmt import AnalysisError

__all__ = ["AnalysisError", "load_inputs"]


def load_inputs(paths: Sequence[str], by_rank: bool = False,  # type: ignore[no-untyped-def]
                quiet: bool = False):
    """Load a trace, turning every unreadable input into an AnalysisError (one line).

    Kineto JSON and Nsight Systems SQLite files are imported on the fly. A glob pattern and
    the name of a multi-node recording stand for their files. With `by_rank`, intact trace
    files written one rank per batch (one, several, or a directory of them) come back as a
    RankedTrace, read one rank at a time by its consumer. `quiet`: the trace's warnings
    are not printed (a second reading of an input already warned of)."""
    import os

    import pyarrow as pa

    from gputrace.fmt import reason

    if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
        # malloc hands each converted column's memory back at once; arrow's own pools keep
        # it a while, which on a 1e7-event trace adds ~40% to the peak
        pa.set_memory_pool(pa.system_memory_pool())
    from gputrace.importers import ImportFailed, import_paths, is_foreign
    from gputrace.trace.ranked import open_ranked, ranked_files
    from gputrace.trace.reader import expand_names, load, unclosed
    from gputrace.trace.schema import TraceFormatError

    foreign = False
    try:
        # globs and the per-node files of a multi-node recording, as their files
        paths = expand_names(paths)
        # a trace that was never written because its recording was killed: its shards
        named = [p for p in paths if unclosed(p) is None]
        foreign = bool(named) and is_foreign(named)
        files = ranked_files(paths) if by_rank and not foreign else None
        ranked = open_ranked(files) if files else None
        if ranked is not None:
            return ranked
        trace = import_paths(list(paths)) if foreign else load(*paths)
    except ImportFailed as e:
        raise AnalysisError(str(e)) from None
    except TraceFormatError as e:
        raise AnalysisError(str(e)) from None
    except (OSError, ValueError, MemoryError) as e:
        raise AnalysisError(f"cannot read {' '.join(paths)}: {e}") from None
    except Exception as e:  # noqa: BLE001 - another tool's file with content not foreseen
        if not foreign:
            raise
        raise AnalysisError(f"cannot import {' '.join(paths)}: {reason(e)}") from None
    for w in [] if quiet else trace.warnings:
        print(f"gputrace: warning: {one_line(w)}", file=sys.stderr)
    return trace


def one_line(text: str) -> str:
    """A message as one line: control characters (a newline in a file name) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
