"""`gputrace probe`: this machine's bandwidths (the paper's Fig. 2), saved per host.

Every figure is a dict with `status` ("ok" or "unavailable: why"). Measured bandwidths have
`bytes_per_s` (the median over repeats), `min_bytes_per_s`, `max_bytes_per_s`, `repeats`,
`bytes` (bytes per repeat) and `method`; latencies have `seconds` instead of `bytes_per_s`.
Analyses read `results[key]["bytes_per_s"]` for the keys named in docs/probe.md.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gputrace.cache import cache_dir

FORMAT = "gputrace-probe"
VERSION = 1


@dataclass(frozen=True)
class Plan:
    mode: str
    size: int                          # bytes of the disk/cache file and the host copy
    repeats: int
    allreduce_sizes: tuple[int, ...]   # bytes per all-reduce; the last gives the figure
    gpu_size: int                      # bytes per GPU copy


def plan(mode: str = "quick", size: int | None = None) -> Plan:
    if mode == "full":
        p = Plan("full", 1 << 30, 10, (1 << 20, 8 << 20, 64 << 20, 256 << 20), 256 << 20)
    else:
        p = Plan("quick", 256 << 20, 3, (32 << 20,), 64 << 20)
    if size is not None:
        p = Plan(p.mode, size, p.repeats,
                 tuple(s for s in p.allreduce_sizes if s < size) + (size,), size)
    return p


def _rates(seconds: Iterable[float], nbytes: int, scale: float) -> list[float]:
    return sorted(scale * nbytes / s for s in seconds if s > 0)


def median_rate(seconds: Iterable[float], nbytes: int, scale: float = 1.0) -> float | None:
    """The median of nbytes/seconds (× scale) over timed repeats; None without any."""
    rates = _rates(seconds, nbytes, scale)
    return statistics.median(rates) if rates else None


def figure(seconds: Iterable[float], nbytes: int, method: str, scale: float = 1.0,
           **extra: Any) -> dict[str, Any]:
    """A bandwidth from timed repeats: median and spread of nbytes/seconds (× scale)."""
    rates = _rates(seconds, nbytes, scale)
    if not rates:
        return unavailable("no timed repeat")
    return {"status": "ok", "bytes_per_s": statistics.median(rates),
            "min_bytes_per_s": rates[0], "max_bytes_per_s": rates[-1],
            "repeats": len(rates), "bytes": int(nbytes), "method": method, **extra}


def latency(seconds: Iterable[float], nbytes: int, method: str) -> dict[str, Any]:
    secs = sorted(s for s in seconds if s > 0)
    if not secs:
        return unavailable("no timed repeat")
    return {"status": "ok", "seconds": statistics.median(secs), "min_s": secs[0],
            "max_s": secs[-1], "repeats": len(secs), "bytes": int(nbytes), "method": method}


def unavailable(why: str) -> dict[str, Any]:
    return {"status": f"unavailable: {why}"}


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- the per-host cache -------------------------------------------------------------------


def cache_path(host: str | None = None) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", host or socket.gethostname())
    return os.path.join(cache_dir(), f"probe-{name}.json")


def save(result: dict[str, Any]) -> str:
    path = cache_path(result.get("host"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)
    return path


def embed(metadata: dict[str, Any]) -> None:
    """Put this host's last probe, when there is one, into a trace's metadata."""
    probe = load_cached(metadata.get("host"))
    if probe:
        metadata["probe"] = probe


def load_cached(host: str | None = None) -> dict[str, Any] | None:
    """The last probe saved on this host, or None (no probe, or an unreadable file)."""
    try:
        with open(cache_path(host)) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("format") != FORMAT or \
            not isinstance(d.get("results"), dict):
        return None
    return d


# -- running ------------------------------------------------------------------------------

Step = tuple[str, Callable[[], dict[str, dict[str, Any]]]]


# what `--only` names each step
STEP_NAMES = ("disk", "memcpy", "gpu", "allreduce", "net", "matmul")


def steps(p: Plan, directory: str, procs: int | None = None,
          only: tuple[str, ...] = ()) -> list[Step]:
    from gputrace.probe import allreduce, gpu, host, matmul, net

    todo = [("disk and page cache read", lambda: host.disk_and_cache(p, directory)),
            ("host memory copy", lambda: host.memcpy(p)),
            ("GPU copies", lambda: gpu.measure(p)),
            ("all-reduce", lambda: allreduce.measure(p, procs)),
            ("network links", net.measure),
            ("matmul FLOP/s", lambda: matmul.measure(p.mode))]
    return [s for s, name in zip(todo, STEP_NAMES, strict=True) if not only or name in only]


def run(p: Plan, directory: str, procs: int | None = None,
        on_step: Callable[[str, int, int], None] | None = None,
        only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Measure everything this machine has; figures it lacks say why they are unavailable."""
    from gputrace import __version__

    t0 = time.time()
    results: dict[str, dict[str, Any]] = {}
    todo = steps(p, directory, procs, only)
    for i, (label, fn) in enumerate(todo):
        if on_step:
            on_step(label, i, len(todo))
        results.update(fn())
    return {"format": FORMAT, "version": VERSION, "host": socket.gethostname(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0)),
            "created_ns": time.time_ns(), "mode": p.mode, "duration_s": round(time.time() - t0, 2),
            "gputrace": __version__, "results": results}
