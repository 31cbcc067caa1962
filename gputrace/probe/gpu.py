"""GPU copies with cupy: H2D/D2H from pageable and pinned memory, D2D, P2P per pair, latency.

Each copy is issued on its own non-blocking stream and timed on the host from the call to
the stream's completion, which is what a training loop waiting on the copy sees.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from gputrace.probe import Plan, figure, latency, median_rate, unavailable

KEYS = ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned", "d2d", "p2p",
        "h2d_latency", "d2h_latency")
D2D = 3  # cudaMemcpyDeviceToDevice
LATENCY_BYTES = 8
LATENCY_REPEATS = 50


def _all_unavailable(why: str) -> dict[str, dict[str, Any]]:
    return {k: unavailable(why) for k in KEYS}


def measure(p: Plan) -> dict[str, dict[str, Any]]:
    try:
        import cupy as cp
        import cupyx
    except Exception as e:  # not installed, or a CUDA library missing
        return _all_unavailable(f"cupy cannot be imported ({type(e).__name__}: {e}); "
                                "pip install gputrace[gpu]")
    try:
        n = int(cp.cuda.runtime.getDeviceCount())
    except Exception as e:
        return _all_unavailable(f"no CUDA device ({type(e).__name__}: {e})")
    if n == 0:
        return _all_unavailable("no CUDA device")
    try:
        return _measure(cp, cupyx, n, p)
    except Exception as e:  # a driver error mid-way: say so rather than fail the probe
        return _all_unavailable(f"CUDA error: {type(e).__name__}: {e}")


def _measure(cp: Any, cupyx: Any, n: int, p: Plan) -> dict[str, dict[str, Any]]:
    import numpy as np

    size = p.gpu_size
    out: dict[str, dict[str, Any]] = {}

    def run(stream: Any, fn: Any, repeats: int) -> list[float]:
        fn()
        stream.synchronize()  # warm-up: first-touch and lazy initialisation
        secs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            stream.synchronize()
            secs.append(time.perf_counter() - t0)
        return secs

    name = cp.cuda.runtime.getDeviceProperties(0).get("name", b"")
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    with cp.cuda.Device(0):
        stream = cp.cuda.Stream(non_blocking=True)
        dev = cp.empty(size, dtype=cp.uint8)
        pageable = np.ones(size, dtype=np.uint8)
        pinned = cupyx.empty_pinned(size, dtype=np.uint8)
        pinned[:] = 1
        how = f"cupy on GPU 0 ({name}), host-timed from the call to the stream's completion"
        for src_kind, host in (("pageable", pageable), ("pinned", pinned)):
            out[f"h2d_{src_kind}"] = figure(
                run(stream, lambda h=host: dev.set(h, stream=stream), p.repeats), size,
                f"host-to-device copy from {src_kind} memory; {how}")
            out[f"d2h_{src_kind}"] = figure(
                run(stream, lambda h=host: dev.get(stream=stream, out=h),
                    p.repeats), size, f"device-to-host copy to {src_kind} memory; {how}")
        dev2 = cp.empty_like(dev)
        out["d2d"] = figure(run(stream, lambda: cp.cuda.runtime.memcpyAsync(
            dev2.data.ptr, dev.data.ptr, size, D2D, stream.ptr), p.repeats), size,
            f"device-to-device copy (bytes copied per second; each is read and written); {how}")
        small = cp.empty(LATENCY_BYTES, dtype=cp.uint8)
        tiny = pinned[:LATENCY_BYTES]
        out["h2d_latency"] = latency(run(stream, lambda: small.set(tiny, stream=stream),
                                         LATENCY_REPEATS), LATENCY_BYTES,
                                     f"{LATENCY_BYTES}-byte copy from pinned memory; {how}")
        out["d2h_latency"] = latency(run(stream, lambda: small.get(
            stream=stream, out=tiny), LATENCY_REPEATS), LATENCY_BYTES,
            f"{LATENCY_BYTES}-byte copy to pinned memory; {how}")
    out["p2p"] = _p2p(cp, n, p, run)
    return out


def _p2p(cp: Any, n: int, p: Plan, run: Any) -> dict[str, Any]:
    if n < 2:
        return unavailable("one GPU: no peer to copy to")
    rt = cp.cuda.runtime
    size = p.gpu_size
    bufs = []
    for d in range(n):
        with cp.cuda.Device(d):
            bufs.append(cp.empty(size, dtype=cp.uint8))
    pairs = []
    for src, dst in itertools.permutations(range(n), 2):
        with cp.cuda.Device(src):
            stream = cp.cuda.Stream(non_blocking=True)

            def copy(src: int = src, dst: int = dst, stream: Any = stream) -> None:
                rt.memcpyPeerAsync(bufs[dst].data.ptr, dst, bufs[src].data.ptr, src, size,
                                   stream.ptr)

            row: dict[str, Any] = {"src": src, "dst": dst,
                                   "can_access_peer": bool(rt.deviceCanAccessPeer(src, dst))}
            row["off_bytes_per_s"] = median_rate(run(stream, copy, p.repeats), size)
            if row["can_access_peer"]:
                enabled = _peer_access(cp, src, dst, True)
                try:
                    row["on_bytes_per_s"] = median_rate(run(stream, copy, p.repeats), size)
                finally:
                    for a, b in enabled:
                        _peer_access(cp, a, b, False)
            pairs.append(row)
    best = [r.get("on_bytes_per_s", r["off_bytes_per_s"]) for r in pairs]
    i = max(range(len(pairs)), key=best.__getitem__)
    top = pairs[i]
    return {"status": "ok", "bytes_per_s": best[i], "min_bytes_per_s": min(best),
            "max_bytes_per_s": best[i], "repeats": p.repeats, "bytes": size,
            "method": f"cudaMemcpyPeerAsync for every ordered GPU pair, peer access off and on; "
                      f"the figure is the fastest pair ({top['src']}->{top['dst']})",
            "pairs": pairs}


def _peer_access(cp: Any, a: int, b: int, on: bool) -> list[tuple[int, int]]:
    """Enable (or disable) peer access both ways; the directions actually changed."""
    rt = cp.cuda.runtime
    changed = []
    for x, y in ((a, b), (b, a)):
        with cp.cuda.Device(x):
            try:
                rt.deviceEnablePeerAccess(y) if on else rt.deviceDisablePeerAccess(y)
                changed.append((x, y))
            except cp.cuda.runtime.CUDARuntimeError:  # already in that state
                pass
    return changed
