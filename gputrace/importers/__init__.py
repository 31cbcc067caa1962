"""Traces made by other tools -> gputrace trace v1.

`detect(path)` says what a file is; `import_paths(paths)` returns a `Trace` like
`gputrace.load` does, so every analysis works on imported traces too.
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from gputrace.importers.common import ImportFailed

__all__ = ["ImportFailed", "detect", "import_paths", "is_foreign"]

_SQLITE = b"SQLite format 3\x00"
_ARROW = b"ARROW1"


def detect(path: str) -> str:
    """'gputrace', 'kineto', 'nsys' or 'tensorflow' (by content, and `.xplane.pb` by name);
    raises ImportFailed otherwise."""
    from gputrace.importers import tfprof_files

    if os.path.isdir(path):
        return "tensorflow" if tfprof_files.is_profile_dir(path) else "gputrace"
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        raise ImportFailed(f"{path}: no such file or directory") from None
    except OSError as e:
        raise ImportFailed(f"{path}: {e.strerror or e}") from None
    if not head:
        raise ImportFailed(f"{path}: the file is empty (0 bytes)")
    if head.startswith(_ARROW):
        return "gputrace"
    if head.startswith(_SQLITE):
        return "nsys"
    if tfprof_files.looks_like(path):
        return "tensorflow"
    if head.startswith(b"\x1f\x8b") or head.lstrip()[:1] in (b"{", b"["):
        return "kineto"
    if path.endswith((".json", ".json.gz")):
        return "kineto"
    raise ImportFailed(f"{path}: neither a gputrace trace, a Kineto/Chrome JSON trace, an "
                       "Nsight Systems SQLite export nor a TensorFlow profile (.xplane.pb)")


def _kineto_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith((".json", ".json.gz")))
        if not files:
            raise ImportFailed(f"{path}: no .json or .json.gz files in this directory")
        return files
    return [path]


def _repeats_said(path: str, found: dict[str, dict[str, Any]]) -> list[str]:
    """One line per rank whose iterations were found from what its trace repeats."""
    return [f"{path}: rank {r}: no iteration marks and no ranges that repeat; one window: "
            f"{v['why']}" if not v["count"] else
            f"{path}: rank {r}: no iteration marks; its iterations are the {v['count']} "
            f"repeats of its kernel sequence from '{v['anchor'][:60]}' on (median "
            f"{v['period_ms']:.1f} ms), each with a backward or optimizer kernel"
            if v.get("from") == "kernels" else
            f"{path}: rank {r}: no iteration marks; its iterations are the {v['count']} "
            f"repeats of the ranges its loop thread runs from '{v['anchor']}' on (median "
            f"{v['period_ms']:.1f} ms): a repeat may be a layer of one pass rather than a "
            "training step" for r, v in sorted(found.items())]


def is_foreign(paths: list[str]) -> bool:
    """True when the inputs are other tools' traces (to import), False for gputrace traces."""
    kinds = set()
    from gputrace.importers import tfprof_files

    for p in paths:
        if os.path.isdir(p) and tfprof_files.is_profile_dir(p):
            kinds.add("tensorflow")
        elif os.path.isdir(p):
            names = os.listdir(p)
            kinds.add("kineto" if names and all(n.endswith((".json", ".json.gz"))
                                                for n in names) else "gputrace")
        else:
            kinds.add(detect(p))
    if len(kinds) > 1 and "gputrace" in kinds:
        raise ImportFailed("mixing gputrace traces with other tools' traces is not supported; "
                           "import the others first (gputrace import)")
    return kinds != {"gputrace"}


def import_paths(paths: list[str]):  # type: ignore[no-untyped-def]
    """Import Kineto JSON files (one per rank, or directories of them), nsys exports and
    TensorFlow profiles (files, or log directories holding them)."""
    import pyarrow.compute as pc

    from gputrace import progress
    from gputrace.importers import kineto, kineto_json, nsys, tfprof, tfprof_files
    from gputrace.importers.common import Rows
    from gputrace.trace.reader import Trace
    from gputrace.trace.schema import conform
    from gputrace.trace.writer import by_rank

    rows = Rows()
    sources: list[dict[str, Any]] = []
    warnings: list[str] = []
    kineto_files = []
    tf_files: list[str] = []
    for p in paths:
        kind = detect(p) if not os.path.isdir(p) or tfprof_files.is_profile_dir(p) else "kineto"
        if kind == "tensorflow":
            tf_files.extend(tfprof_files.profile_files(p))
        elif kind == "nsys":
            try:
                info = nsys.read(p, rows)
            except ImportFailed as e:
                raise ImportFailed(f"{p}: {e}") from None
            except sqlite3.Error as e:
                raise ImportFailed(f"{p}: unreadable SQLite database ({e})") from None
            sources.append({"path": os.path.abspath(p), "tool": "nsys", **info})
            warnings.append(f"{p}: ranks assigned one per process in the order of their "
                            "lowest GPU (an Nsight Systems export does not record ranks)")
            warnings.extend(_repeats_said(p, info.get("inferred_iterations") or {}))
        elif kind == "kineto":
            kineto_files.extend(_kineto_files(p))
        else:
            raise ImportFailed(f"{p} is a gputrace trace already")
    seen: dict[int, str] = {}
    unnamed = 0
    for f in progress.each(kineto_files, "importing Kineto files"):
        try:
            dist = kineto_json.top_level(f, "distributedInfo")
        except (ImportFailed, OSError, ValueError):
            dist = None
        rank = kineto.rank_of(f, dist)
        if rank is None:
            if len(kineto_files) > 1:
                raise ImportFailed(f"{f}: cannot tell its rank: no distributedInfo in the file "
                                   "and no 'rank<N>' in its name; rename it e.g. rank0.json")
            warnings.append(f"{f}: no distributedInfo and no rank in the name; taken as rank 0")
            rank = 0
            unnamed += 1
        if rank in seen:
            raise ImportFailed(f"{f} and {seen[rank]} are both rank {rank}")
        seen[rank] = f
        try:
            counts = kineto.read(f, rank, rows)
        except ImportFailed as e:
            raise ImportFailed(f"{f}: {e}") from None
        sources.append({"path": os.path.abspath(f), "tool": "kineto", "rank": rank,
                        "distributedInfo": dist if isinstance(dist, dict) else None, **counts})
        warnings.extend(_repeats_said(f, counts.get("inferred_iterations") or {}))
    for f, rank in zip(tf_files, tfprof_files.ranks_of(tf_files), strict=True):
        if rank in seen:
            raise ImportFailed(f"{f} and {seen[rank]} are both rank {rank}")
        seen[rank] = f
        try:
            counts = tfprof.read(f, rank, rows)
        except ImportFailed as e:
            raise ImportFailed(str(e) if str(e).startswith(f) else f"{f}: {e}") from None
        sources.append({"path": os.path.abspath(f), "tool": "tensorflow", "rank": rank,
                        **counts})
    worlds = [s["distributedInfo"].get("world_size") for s in sources
              if isinstance(s.get("distributedInfo"), dict)]
    worlds = [w for w in worlds if isinstance(w, int) and w > 0]
    table = rows.table()
    if table.num_rows == 0:
        raise ImportFailed(f"{' '.join(paths)}: no events to import")
    table = by_rank(conform(table))       # as write_by_rank keeps it: no second sort there
    start = table.column("start_ns")
    ranks = sorted({int(r) for r in table.column("rank").unique().to_pylist() if r >= 0})
    md: dict[str, Any] = {
        "format": "gputrace-trace", "version": 1, "role": "import",
        "host": "", "imported": sources, "ranks": ranks,
        "world_size": max(worlds) if worlds else len(ranks),
        "start": {"realtime_ns": int(pc.min(start).as_py()) if len(start) else 0},
    }
    return Trace(table, md, [os.path.abspath(p) for p in paths], warnings)
