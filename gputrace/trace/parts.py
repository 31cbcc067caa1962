"""How the files of one run are found from the one name the user gives (`run.arrow`): the
per-node files of a recording across nodes (`run.HOST.arrow`, which each name `run.arrow` as
what they are a part of), and the files that recordings of the same moment put beside a
`run.arrow` they found taken (`run.HOST.arrow`, `run.HOST.PID.arrow`)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from gputrace.trace.schema import TraceFormatError, read_metadata


def metadata_of(path: str) -> dict[str, Any] | None:
    """The gputrace metadata of a trace file, or None where it has none that can be read."""
    try:
        with pa.OSFile(path) as src:
            return read_metadata(pa.ipc.open_file(src).schema)
    except (TraceFormatError, pa.ArrowException, OSError, ValueError):
        return None


def window(md: dict[str, Any] | None) -> tuple[int, int] | None:
    """When a recording ran (realtime ns, start and end), where its metadata says."""
    try:
        start = int(md["start"]["realtime_ns"])  # type: ignore[index]
        end = int(md["end"]["realtime_ns"])      # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None
    return start, max(start, end)


def same_moment(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two recordings ran at the same time (their windows overlap); False where
    either does not say when it ran."""
    wa, wb = window(a), window(b)
    return wa is not None and wb is not None and wa[0] <= wb[1] and wb[0] <= wa[1]


def node_files(path: str | os.PathLike[str], with_: dict[str, Any] | None = None
               ) -> list[str]:
    """The files of a recording of `path` beside it (`run.HOST.arrow` for `run.arrow`, each
    naming `run.arrow` as what it is a part of), sorted; with the metadata of `path` itself
    (`with_`), only those recorded at the same moment (not a part left from an earlier run)."""
    import glob

    path = os.fspath(path)
    stem, ext = os.path.splitext(path)
    out = []
    for f in sorted(glob.glob(f"{glob.escape(stem)}.*{glob.escape(ext)}")):
        md = metadata_of(f)
        if md is None or md.get("node_of") != os.path.basename(path):
            continue
        if with_ is not None and not same_moment(md, with_):
            continue
        out.append(f)
    return out


def expand_names(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """The paths to read, as given, except: a glob pattern (`'run/*.arrow'`, quoted so the
    shell leaves it) becomes the files it matches; a trace path that was recorded on
    several nodes (so does not exist itself) becomes its per-node files (`node_files`); and
    a trace file that other recordings of the same moment found taken comes with the files
    they put beside it. Directories and unclosed recordings are left to the reader."""
    import glob

    out: list[str] = []
    for p in map(os.fspath, paths):
        if os.path.isfile(p):
            md = metadata_of(p)
            out.append(p)
            if md is not None and md.get("node_of") == os.path.basename(p):
                out.extend(node_files(p, with_=md))
        elif os.path.exists(p):
            out.append(p)
        elif glob.has_magic(p):
            found = sorted(glob.glob(p))
            if not found:
                raise TraceFormatError(f"{p}: no file matches")
            out.extend(found)
        else:
            out.extend(node_files(p) or [p])
    return list(dict.fromkeys(out))   # once each, however often named or found
