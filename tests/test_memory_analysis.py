"""The memory analysis on traces whose answer is known by construction: the phase a peak is
attributed to where phases nest (Lightning runs forward and backward inside the optimizer's
step) and where it rose between phases, and the capacity findings of a GPU (the CUDA
allocator's peak against the GPU's memory, NVML's used memory against the inventory) and of
a host whose ranks together fill it. The recorded path is checked end to end in
tests/test_throughput.py."""

from __future__ import annotations

import json

import pyarrow as pa

from gputrace.analyzers.extras.memory import analyze_memory
from gputrace.analyzers.extras.memory_phases import OUTSIDE
from gputrace.analyzers.findings.findings_memory import memory_findings

GIB = 2**30


def _table(rows: list[dict]) -> pa.Table:
    cols = ("kind", "cat", "name", "host", "rank", "pid", "device", "value", "start_ns",
            "args")
    return pa.table({c: [r.get(c) for r in rows] for c in cols})


def _mark(t: int, phase: str, end: bool, rss: float, hwm: float | None = None,
          rank: int = 0, alloc: tuple[float, float] | None = None) -> list[dict]:
    args = json.dumps({"phase": phase, "edge": "end" if end else "start"})
    base = {"kind": "sample", "cat": "memory", "host": "h", "rank": rank, "pid": 10 + rank,
            "device": -1, "start_ns": t, "args": args}
    out = [dict(base, name="rss", value=rss)]
    if hwm is not None:
        out.append(dict(base, name="rss_peak", value=hwm))
    if alloc is not None:
        out.append(dict(base, name="cuda_allocated", value=alloc[0], device=0))
        out.append(dict(base, name="cuda_allocated_peak", value=alloc[1], device=0))
    return out


def _sample(name: str, value: float, rank: int = 0, device: int = -1, cat: str = "memory",
            host: str = "h") -> dict:
    return {"kind": "sample", "cat": cat, "name": name, "host": host, "rank": rank,
            "pid": 10 + rank, "device": device, "value": value, "start_ns": 0, "args": None}


def test_a_peak_inside_a_nested_phase_and_one_between_phases():
    """update wraps forward and backward (a closure): the high-water mark that rose by the
    end of backward rose in backward, the one after backward's end in update; a later
    loop whose peak rose between backward's end and update's start is `outside phases`."""
    rows = [*_mark(1, "update", False, 1.0 * GIB, 1.0 * GIB),
            *_mark(2, "forward", False, 1.0 * GIB),
            *_mark(3, "forward", True, 1.5 * GIB, 1.5 * GIB),
            *_mark(4, "backward", False, 1.5 * GIB),
            *_mark(5, "backward", True, 1.2 * GIB, 2.0 * GIB),   # a transient inside
            *_mark(6, "update", True, 1.2 * GIB)]
    m = analyze_memory(_table(rows), 0)
    assert m["rss_peak_bytes"] == 2.0 * GIB and m["rss_peak_phase"] == "backward"
    assert m["phases"]["backward"]["rss_peak_bytes"] == 2.0 * GIB
    assert m["phases"]["forward"]["rss_peak_bytes"] == 1.5 * GIB
    later = [*_mark(7, "update", False, 1.2 * GIB),
             *_mark(8, "update", True, 1.2 * GIB),
             *_mark(9, "forward", False, 3.0 * GIB, 3.0 * GIB)]     # rose before it began
    m = analyze_memory(_table(rows + later), 0)
    assert m["rss_peak_phase"] == OUTSIDE
    # a phase's own peak leaves out the phases inside it (the innermost names the memory)
    assert m["phases"]["update"]["rss_peak_bytes"] == 1.2 * GIB


def test_capacity_findings_of_a_gpu_nvml_and_a_host():
    """Rank 0's allocator peak at 95 % of its GPU, NVML's GPU 1 at 92 % of its inventory,
    two ranks together at 93 % of their host: three findings with their numbers; at 80 %
    none."""
    rows = [*_mark(1, "forward", False, 7 * GIB, 7 * GIB, alloc=(10 * GIB, 10 * GIB)),
            *_mark(2, "forward", True, 7 * GIB, 7 * GIB, alloc=(76 * GIB, 76 * GIB)),
            _sample("cuda_total", 80 * GIB, device=0), _sample("host_total", 16 * GIB),
            *_mark(1, "forward", False, 7.9 * GIB, 7.9 * GIB, rank=1),
            _sample("host_total", 16 * GIB, rank=1),
            _sample("gpu.mem_used", 73.6 * GIB, rank=-1, device=1, cat="gpu")]
    md = {"shards": [{"host": "h", "collectors": {"nvml": {"gpus": [
        {"index": 1, "memory_bytes": 80 * GIB}]}}}]}
    m = analyze_memory(_table(rows), 0, md)
    assert m["cuda"][0]["allocated_peak_phase"] == "forward"
    assert m["gpus"] == [{"host": "h", "device": 1, "used_peak_bytes": 73.6 * GIB,
                          "total_bytes": 80 * GIB}]
    found = [f.message for f in memory_findings(m) if f.id == "memory_near_capacity"]
    assert len(found) == 3, found
    assert "Rank 0 allocated up to 76.00 GiB of its GPU's 80.00 GiB (95%) (in forward)" \
        in found[0]
    assert "ranks 0, 1 together peaked at 14.90 GiB resident of 16.00 GiB (93%)" in found[1]
    assert "GPU 1 on h had 73.60 GiB of 80.00 GiB in use at its peak (92%" in found[2]
    roomy = [dict(r, value=r["value"] * 0.8) if r["name"] in (
        "cuda_allocated_peak", "cuda_allocated", "gpu.mem_used", "rss", "rss_peak") else r
        for r in rows]
    assert not memory_findings(analyze_memory(_table(roomy), 0, md))
