"""Disk sequential read (page cache dropped), page-cache read and host memory copy."""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from typing import Any

from gputrace.probe import Plan, figure, timed, unavailable

CHUNK = 8 << 20


def _write(path: str, size: int) -> float:
    """Write `size` bytes of incompressible data and fsync; returns the seconds it took."""
    import numpy as np

    block = np.random.default_rng().integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(block[:min(left, CHUNK)])
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read(path: str, buf: memoryview) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            n += k


def _read_direct(path: str, buf: mmap.mmap) -> int:
    """O_DIRECT read into a page-aligned buffer: bypasses the page cache entirely."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    n = 0
    try:
        while True:
            k = os.readv(fd, [buf])
            if not k:
                return n
            n += k
    finally:
        os.close(fd)


def _disk_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().io_counters().read_bytes)
    except Exception:  # no per-process I/O accounting on this OS
        return None


def disk_and_cache(p: Plan, directory: str) -> dict[str, dict[str, Any]]:
    fd, path = tempfile.mkstemp(prefix=".gputrace-probe-", suffix=".bin", dir=directory)
    os.close(fd)
    out: dict[str, dict[str, Any]] = {}
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        t_write = _write(path, p.size)
        out["disk_write"] = figure([t_write], p.size, "sequential write of a new file, then "
                                   "fsync", path=directory)
        disk: list[float] = []
        verified: bool | None = True
        for _ in range(p.repeats):
            _drop(path)
            before = _disk_bytes()
            t0 = time.perf_counter()
            _read(path, view)
            disk.append(time.perf_counter() - t0)
            after = _disk_bytes()
            if before is None or after is None:
                verified = None
            elif after - before < p.size // 2:
                verified = False
                break
        if verified is False and hasattr(os, "O_DIRECT"):
            # the cache could not be dropped (e.g. tmpfs, some network filesystems)
            abuf = mmap.mmap(-1, CHUNK)
            try:
                disk = timed(lambda: _read_direct(path, abuf), p.repeats)
                out["disk_read"] = figure(disk, p.size, "sequential read with O_DIRECT "
                                          "(posix_fadvise could not drop the page cache here)",
                                          path=directory)
            except OSError as e:
                out["disk_read"] = unavailable(
                    f"the page cache cannot be bypassed under {directory}: posix_fadvise"
                    f"(DONTNEED) left the file cached and O_DIRECT failed ({e.strerror})")
            finally:
                abuf.close()
        elif verified is False:
            out["disk_read"] = unavailable(f"the page cache cannot be dropped under {directory}")
        else:
            out["disk_read"] = figure(
                disk, p.size, "sequential read after posix_fadvise(DONTNEED)"
                + (", disk reads confirmed by the process's read_bytes" if verified
                   else " (not confirmed: no per-process I/O counters)"), path=directory)
        _read(path, view)  # warm the cache
        out["cache_read"] = figure(timed(lambda: _read(path, view), p.repeats), p.size,
                                   "sequential read of a file in the page cache",
                                   path=directory)
    finally:
        os.unlink(path)
    return out


def memcpy(p: Plan) -> dict[str, dict[str, Any]]:
    import numpy as np

    src = np.ones(p.size, dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # touch every page first
    secs = timed(lambda: np.copyto(dst, src), p.repeats)
    return {"memcpy": figure(secs, p.size, "one-thread host memory copy (numpy.copyto); "
                             "bytes copied per second")}
