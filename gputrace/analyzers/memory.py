"""Memory per rank from the `memory` samples (collectors.memory): each rank's peak resident
set size and, where its torch used CUDA, the caching allocator's peaks per device."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from gputrace.analyzers.window import stored_rank
from gputrace.collectors.memory import CAT

UNAVAILABLE = ("no memory samples in this trace (recorded before gputrace sampled memory, "
               "or imported from another tool)")


def analyze_memory(table: pa.Table, rank: int) -> dict[str, Any]:
    """`memory` of analyze --json: `rank`'s peaks, and every rank's peak RSS."""
    m = pc.and_(pc.equal(table["kind"].cast(pa.string()), "sample"),
                pc.equal(table["cat"].cast(pa.string()), CAT))
    rows = table.filter(m).select(["name", "rank", "pid", "device", "value"]).to_pylist()
    if not rows:
        return {"rss_peak_bytes": None, "cuda": [], "ranks": {}, "unavailable": UNAVAILABLE}
    if stored_rank(table, 0) == -1:    # one process that never said its rank
        for r in rows:
            r["rank"] = 0 if r["rank"] == -1 else r["rank"]
    rss: dict[int, float] = {}
    cuda: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        if r["rank"] < 0:
            continue
        if r["name"] == "rss_peak":
            rss[r["rank"]] = max(rss.get(r["rank"], 0.0), r["value"])
        elif r["name"] in ("cuda_allocated_peak", "cuda_reserved_peak"):
            d = cuda.setdefault((r["rank"], r["device"]), {})
            key = r["name"].replace("cuda_", "") + "_bytes"
            d[key] = max(d.get(key, 0.0), r["value"])
    mine = [{"device": dev, **v} for (rk, dev), v in sorted(cuda.items()) if rk == rank]
    largest = max(rss, key=lambda k: rss[k]) if rss else None
    return {"rss_peak_bytes": rss.get(rank), "cuda": mine,
            "ranks": {str(k): {"rss_peak_bytes": v,
                               "cuda_allocated_peak_bytes": max(
                                   [c.get("allocated_peak_bytes", 0.0) for (rk, _), c
                                    in cuda.items() if rk == k], default=None)}
                      for k, v in sorted(rss.items())},
            "largest_rank": largest, "unavailable": None}


def memory_line(m: dict[str, Any], rank: int) -> str | None:
    """The terminal's line: this rank's peaks, and the largest rank's where it differs."""
    if m.get("unavailable") or m.get("rss_peak_bytes") is None:
        return None
    gib = 2.0 ** 30
    parts = [f"peak RSS {m['rss_peak_bytes'] / gib:.2f} GiB"]
    for c in m["cuda"]:
        if "allocated_peak_bytes" in c:
            parts.append(f"GPU {c['device']} allocated peak "
                         f"{c['allocated_peak_bytes'] / gib:.2f} GiB (reserved "
                         f"{c.get('reserved_peak_bytes', 0) / gib:.2f})")
    big = m.get("largest_rank")
    if big is not None and big != rank and len(m["ranks"]) > 1:
        parts.append(f"largest on rank {big}: "
                     f"{m['ranks'][str(big)]['rss_peak_bytes'] / gib:.2f} GiB")
    return f"Memory (rank {rank}): " + "; ".join(parts)
