"""Kineto (PyTorch profiler) / Chrome trace JSON -> trace v1 rows.

The file is read whole and parsed by msgspec into typed structs of only the fields gputrace
uses: the event list first as raw slices of the text (a few dozen bytes each), then 65536
events at a time into structs, converted and dropped, so memory follows the JSON text and the
output rows, not a Python object of every event."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from gputrace import progress
from gputrace.importers import kernel_steps
from gputrace.importers.common import (
    ImportFailed,
    Launches,
    Rows,
    attribute_launches,
    loop_threads,
)
from gputrace.importers.host_ops import HostOps
from gputrace.importers.kineto_convert import convert_batch
from gputrace.importers.kineto_groups import Groups
from gputrace.importers.kineto_json import as_int, document, events

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_BATCH = 1 << 16


def rank_of(path: str, dist: Any) -> int | None:
    if isinstance(dist, dict) and isinstance(dist.get("rank"), int) and dist["rank"] >= 0:
        return int(dist["rank"])
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def read(path: str, rank: int, rows: Rows, *, phases: Sequence[tuple[Any, int, int, str]] = (),
         iters: Sequence[tuple[int, int, int]] = (), gpu_only: bool = False,
         threads: dict[int, int] | None = None, loops: dict[int, Any] | None = None
         ) -> dict[str, Any]:
    """Append one Kineto file's events to `rows` as `rank`; return what the file says of itself.

    `phases` ((pid, tid), start, end, cat) and `iters` (start, end, step) add ranges known
    from elsewhere (gputrace's own spans) for attributing GPU work to the range of its
    launch; `gpu_only` leaves out the file's CPU-side ranges. `threads` maps pthread ids
    (low 32 bits) to native TIDs: Kineto names a launching thread it saw no operator on by
    the low 32 bits of its pthread_self, as a signed int. `loops`: pid -> (pid, tid) of the
    training loop's thread (found from the file's iterations or phases when not given).

    Where the file does not name forward and backward (torch.profiler without module
    ranges), they are found from the order of the loop thread's operators (see
    `HostOps.infer`) and written as `forward`/`backward` spans named `... (inferred)`."""
    launches = Launches()
    fixed: set[int] = set()
    h2d: set[int] = set()
    phases = list(phases)
    iters = list(iters)
    iter_threads: dict[Any, int] = {}
    ops = HostOps()
    groups = Groups()
    counts: dict[str, Any] = {"events": 0, "skipped": 0}
    doc = document(path)
    base = doc.top.baseTimeNanoseconds
    base_ns = as_int(base) if base is not None else 0
    if base_ns < 0:
        raise ImportFailed(f"baseTimeNanoseconds = {base!r} is not a time in ns")
    absent = doc.top.traceEvents is None
    raws = doc.top.traceEvents or []
    doc.top.traceEvents = None
    del doc
    first = rows.count
    for lo in progress.each(range(0, len(raws), _BATCH),
                            f"converting {os.path.basename(path)} (batches of events)"):
        convert_batch(events(raws[lo:lo + _BATCH], lo), lo, rank, rows, base_ns, gpu_only,
                      threads, launches, fixed, h2d, phases, iters, iter_threads, ops, counts,
                      groups)
    counts["events"] = len(raws)
    groups.resolve(rows)
    del raws
    if counts["events"] == 0:
        raise ImportFailed("no 'traceEvents' in it: not a Kineto/Chrome trace" if absent else
                           "its 'traceEvents' is empty: the profiler recorded no events")
    if loops is None:
        loops = loop_threads(phases, iter_threads)
    inferred = ops.infer(loops)
    if not iters:       # no iteration marks: where the loop thread's ranges repeat
        for key, rep in ops.repeats(loops).items():
            n = len(rep.start)
            iters.extend((st, en, k) for k, (st, en) in enumerate(
                zip(rep.start.tolist(), rep.end.tolist(), strict=True)))
            rows.add_columns(n, kind="span", cat="iteration",
                             name=f"iteration (repeat of {rep.anchor})", start_ns=rep.start,
                             end_ns=rep.end, rank=rank, pid=key[0], tid=key[1],
                             step=list(range(n)))
            counts.setdefault("inferred_iterations", {})[str(rank)] = {
                "anchor": rep.anchor, "count": n, "period_ms": round(rep.period_ns / 1e6, 3)}
    if not iters:       # nor host ranges that repeat: where its kernel sequence repeats
        found = kernel_steps.add(rows, kernel_steps.find(rows, first, {rank}))
        if found:
            counts.setdefault("inferred_iterations", {}).update(found)
    for (pid, tid), s, e, cat in inferred:
        rows.add("span", cat, f"{cat} (inferred)", s, e, rank=rank, pid=pid, tid=tid)
    counts["inferred_phases"] = len(inferred)
    attribute_launches(rows, phases + inferred, iters, launches, fixed, loops, h2d)
    return counts
