"""Iterations of a GPU trace with no iteration mark and no host ranges that repeat, from
what its kernel sequence repeats: on each rank's busiest compute stream, the longest
sequence of kernels that recurs, where each recurrence runs a backward or optimizer
kernel (a training step, not a layer or a forward pass)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gputrace.importers import repeats as rp
from gputrace.importers.common import Rows


def find(rows: Rows, first: int, ranks: set[int]) -> dict[int, tuple[rp.Repeats | None, str,
                                                                     int]]:
    """rank -> (its steps or None, why none, the pid of its kernels) for each of `ranks`
    with kernels among the rows added from `first` on."""
    t = rows.since(first, ["cat", "name", "start_ns", "end_ns", "rank", "pid", "device",
                           "stream"])
    if not t.num_rows:
        return {}
    cols = {c: t.column(c).to_pylist() for c in ("cat", "rank")}
    keep = np.array([c == "kernel" and r in ranks
                     for c, r in zip(cols["cat"], cols["rank"], strict=True)], bool)
    if not keep.any():
        return {}
    idx = np.flatnonzero(keep)

    def arr(c: str) -> np.ndarray:
        return np.array([-1 if v is None else v for v in t.column(c).take(idx).to_pylist()],
                        np.int64)

    rank, pid, dev, stream = arr("rank"), arr("pid"), arr("device"), arr("stream")
    start, end = arr("start_ns"), arr("end_ns")
    names = t.column("name").take(idx).to_pylist()
    out: dict[int, tuple[rp.Repeats | None, str, int]] = {}
    for r in np.unique(rank).tolist():
        mine = np.flatnonzero(rank == r)
        lanes, n = np.unique(np.column_stack((dev[mine], stream[mine])), axis=0,
                             return_counts=True)
        d, s = lanes[int(np.argmax(n))].tolist()
        sel = mine[(dev[mine] == d) & (stream[mine] == s)]
        sel = sel[np.argsort(start[sel], kind="stable")]
        rep, why = rp.kernel_steps([names[i] for i in sel.tolist()], start[sel], end[sel])
        p_, c = np.unique(pid[sel], return_counts=True)
        out[int(r)] = (rep, why, int(p_[int(np.argmax(c))]))
    return out


def add(rows: Rows, found: dict[int, tuple[rp.Repeats | None, str, int]],
        iters: list[tuple[int, int, int]] | None = None) -> dict[str, dict[str, Any]]:
    """Write the iterations found as `iteration` spans (GPU time, from the anchor kernel's
    start to the next one's); return rank -> what was found or why nothing was."""
    said: dict[str, dict[str, Any]] = {}
    for r, (rep, why, pid) in sorted(found.items()):
        if rep is None:
            said[str(r)] = {"from": "kernels", "count": 0, "why": why}
            continue
        n = len(rep.start)
        rows.add_columns(n, kind="span", cat="iteration",
                         name=f"iteration (kernel repeat of {rep.anchor[:80]})",
                         start_ns=rep.start, end_ns=rep.end, rank=r, pid=pid,
                         step=np.arange(n))
        if iters is not None:
            iters.extend((s, e, k) for k, (s, e) in enumerate(
                zip(rep.start.tolist(), rep.end.tolist(), strict=True)))
        said[str(r)] = {"from": "kernels", "anchor": rep.anchor, "count": n,
                        "period_ms": round(rep.period_ns / 1e6, 3)}
    return said
