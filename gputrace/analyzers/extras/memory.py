"""Memory per rank from the `memory` samples (collectors.memory): each rank's peak resident
set size and, where its torch used CUDA, the caching allocator's peaks per device; the
phase each peak happened in and each phase's peak (analyzers.extras.memory_phases); the machine's
and the GPUs' capacity; and the GPUs' used memory as NVML sampled it (`gpu.mem_used`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from gputrace.analyzers.extras.memory_phases import OUTSIDE, Attribution, attribute
from gputrace.analyzers.extras.window import stored_of, stored_rank
from gputrace.collectors.memory import CAT, PHASES

UNAVAILABLE = ("no memory samples in this trace (recorded before gputrace sampled memory, "
               "or imported from another tool)")
COLUMNS = ("kind", "cat", "name", "host", "rank", "pid", "device", "value", "start_ns", "args")
_ORDER = (*PHASES, OUTSIDE)


def empty() -> dict[str, Any]:
    return {"rss_peak_bytes": None, "rss_peak_phase": None, "phases": {},
            "host_total_bytes": None, "cuda": [], "gpus": [], "ranks": {},
            "largest_rank": None, "unavailable": UNAVAILABLE}


def is_memory(table: pa.Table) -> pa.ChunkedArray:
    """Which rows of a table (kind, cat, name) are memory samples or NVML's used memory."""
    cat = table["cat"].cast(pa.string())
    return pc.and_(pc.equal(table["kind"].cast(pa.string()), "sample"),
                   pc.or_(pc.equal(cat, CAT), pc.and_(pc.equal(cat, "gpu"), pc.equal(
                       table["name"].cast(pa.string()), "gpu.mem_used"))))


def memory_rows(table: pa.Table, present: Collection[int] | None = None
                ) -> list[dict[str, Any]]:
    """The trace's memory samples and NVML's used-memory samples, as dicts; `present`: the
    ranks the trace's rows carry, where `table` holds only some of its rows (else its
    own)."""
    cols = [c for c in COLUMNS[2:] if c in table.column_names]
    rows = table.filter(is_memory(table)).select(cols).to_pylist()
    stored = stored_rank(table, 0) if present is None else stored_of(present, 0)
    if rows and stored == -1:    # one process that never said its rank
        for r in rows:
            if r["name"] != "gpu.mem_used":
                r["rank"] = 0 if r["rank"] == -1 else r["rank"]
    return rows


def analyze_memory(table: pa.Table, rank: int, metadata: dict[str, Any] | None = None,
                   present: Collection[int] | None = None) -> dict[str, Any]:
    """`memory` of analyze --json: `rank`'s peaks, with the phases they happened in, and
    every rank's (`present`: as memory_rows takes it)."""
    rows = memory_rows(table, present)
    gpus = _nvml(rows, metadata or {})
    rows = [r for r in rows if r["name"] != "gpu.mem_used" and r["rank"] >= 0]
    if not rows:
        return {**empty(), "gpus": gpus}
    by_pid: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_pid[r["rank"], r["pid"]].append(r)
    ranks = {}
    for rk in sorted({k[0] for k in by_pid}):
        ranks[rk] = _rank({pid: rs for (r, pid), rs in by_pid.items() if r == rk})
    out: dict[str, Any] = {k: None for k in ("rss_peak_bytes", "rss_peak_phase",
                                               "host_total_bytes")}
    mine = ranks.get(rank)
    if mine is not None:
        out.update({k: mine[k] for k in out})
    out["phases"] = mine["phases"] if mine else {}
    out["cuda"] = mine.pop("_cuda") if mine else []
    for v in ranks.values():
        v.pop("_cuda", None)
    out["gpus"] = gpus
    rss = {k: v["rss_peak_bytes"] for k, v in ranks.items() if v["rss_peak_bytes"] is not None}
    out["ranks"] = {str(k): v for k, v in ranks.items()}
    out["largest_rank"] = max(rss, key=lambda k: rss[k]) if rss else None
    out["unavailable"] = None
    return out


def _rank(pids: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """One rank's figures from its processes' rows."""
    att: dict[int, Attribution] = {pid: attribute(rs) for pid, rs in pids.items()}
    peak: dict[tuple[str, int], tuple[float, int]] = {}      # (name, device) -> (max, pid)
    for pid, rs in pids.items():
        for r in rs:
            key = (r["name"], int(r["device"]))
            if r["value"] is not None and r["value"] > peak.get(key, (-1.0, 0))[0]:
                peak[key] = (float(r["value"]), pid)

    def top(name: str, dev: int = -1) -> float | None:
        return peak[name, dev][0] if (name, dev) in peak else None

    # a peak is at least what was read at a boundary (the two counters lag by a few pages)
    for cur, pk in (("rss", "rss_peak"), ("cuda_allocated", "cuda_allocated_peak")):
        for (n, dev), got in list(peak.items()):
            if n == cur and got[0] > peak.get((pk, dev), (-1.0, 0))[0]:
                peak[pk, dev] = got

    def phase_of(measure: str, name: str, dev: int) -> str | None:
        if (name, dev) not in peak:
            return None
        v, pid = peak[name, dev]
        return att[pid].peak_phase((measure, dev), v)

    phases: dict[str, dict[str, float]] = {}
    devices = sorted({d for n, d in peak if n.startswith("cuda_")})
    for a in att.values():
        for (measure, _dev), got in a.phases.items():
            key = "rss_peak_bytes" if measure == "rss" else "cuda_allocated_peak_bytes"
            for ph, v in got.items():
                d = phases.setdefault(ph, {})
                d[key] = max(d.get(key, 0.0), v)
    cuda = []
    for dev in devices:
        c: dict[str, Any] = {"device": dev}
        for name, key in (("cuda_allocated_peak", "allocated_peak_bytes"),
                          ("cuda_reserved_peak", "reserved_peak_bytes"),
                          ("cuda_total", "total_bytes")):
            if (name, dev) in peak:
                c[key] = top(name, dev)
        c["allocated_peak_phase"] = phase_of("cuda_allocated", "cuda_allocated_peak", dev)
        cuda.append(c)
    alloc = [(c.get("allocated_peak_bytes", 0.0), c) for c in cuda if "allocated_peak_bytes" in c]
    big = max(alloc, key=lambda x: x[0])[1] if alloc else None
    host = next((r["host"] for rs in pids.values() for r in rs if r.get("host")), None)
    return {"host": host,
            "rss_peak_bytes": top("rss_peak"),
            "rss_peak_phase": phase_of("rss", "rss_peak", -1),
            "host_total_bytes": top("host_total"),
            "cuda_allocated_peak_bytes": big["allocated_peak_bytes"] if big else None,
            "cuda_allocated_peak_phase": big["allocated_peak_phase"] if big else None,
            "cuda_total_bytes": big.get("total_bytes") if big else None,
            "phases": {p: phases[p] for p in _ORDER if p in phases},
            "_cuda": cuda}


def _nvml(rows: list[dict[str, Any]], metadata: dict[str, Any]) -> list[dict[str, Any]]:
    """Each GPU's peak used memory as NVML sampled it (all its processes, and others'),
    with its total from the recording's GPU inventory."""
    used: dict[tuple[str, int], float] = {}
    for r in rows:
        if r["name"] == "gpu.mem_used" and r["value"] is not None:
            key = (r.get("host") or "", int(r["device"]))
            used[key] = max(used.get(key, 0.0), float(r["value"]))
    if not used:
        return []
    totals: dict[tuple[str, int], float] = {}
    shards = metadata.get("shards") if isinstance(metadata.get("shards"), list) else [metadata]
    for md in shards:
        if not isinstance(md, dict):
            continue
        nv = (md.get("collectors") or {}).get("nvml") or {}
        for g in nv.get("gpus") or [] if isinstance(nv, dict) else []:
            if isinstance(g, dict) and g.get("memory_bytes"):
                totals[str(md.get("host") or ""), int(g.get("index", -1))] = \
                    float(g["memory_bytes"])
    return [{"host": h, "device": d, "used_peak_bytes": v, "total_bytes": totals.get((h, d))}
            for (h, d), v in sorted(used.items())]


def _gib(v: float) -> str:
    return f"{v / 2.0 ** 30:.2f} GiB"


def memory_line(m: dict[str, Any], rank: int) -> str | None:
    """The terminal's line: this rank's peaks and the phases they happened in, and the
    largest rank's where it differs."""
    if m.get("unavailable") or m.get("rss_peak_bytes") is None:
        return None
    ph = m.get("rss_peak_phase")
    parts = [f"peak RSS {_gib(m['rss_peak_bytes'])}" + (f" in {ph}" if ph else "")]
    for c in m["cuda"]:
        if "allocated_peak_bytes" in c:
            where = c.get("allocated_peak_phase")
            parts.append(f"GPU {c['device']} allocated peak "
                         f"{_gib(c['allocated_peak_bytes'])}"
                         + (f" in {where}" if where else "")
                         + f" (reserved {c.get('reserved_peak_bytes', 0) / 2.0 ** 30:.2f})")
    big = m.get("largest_rank")
    if big is not None and big != rank and len(m["ranks"]) > 1:
        parts.append(f"largest on rank {big}: "
                     f"{_gib(m['ranks'][str(big)]['rss_peak_bytes'])}")
    who = f" (rank {rank})" if len(m["ranks"]) > 1 or rank > 0 else ""   # one process: none
    return f"Memory{who}: " + "; ".join(parts)
