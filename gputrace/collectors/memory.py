"""Memory per process. Two readers, both cheap:

- at each flush of the recorder's writer thread (nothing on the training loop's path): the
  peak resident set size (getrusage's ru_maxrss), and where the job's torch has initialized
  CUDA, the caching allocator's peaks per device (max_memory_allocated,
  max_memory_reserved); the machine's memory (MemTotal) and each used GPU's once. `sample`
  rows of cat `memory`, names `rss_peak`, `cuda_allocated_peak`, `cuda_reserved_peak`,
  written when they grew (peaks only rise), `host_total` and `cuda_total`; in bytes.
- at the boundaries of the training loop's phases (`PhaseMemory.mark`, called by the torch
  hooks and `gputrace.phase`): the current resident set size (/proc/self/statm, one pread of
  an open file) and its high-water mark (getrusage), and on CUDA the allocator's current
  and peak allocated bytes of the current device, as rows `rss`, `rss_peak` (when it grew),
  `cuda_allocated` and `cuda_allocated_peak` (when it changed) whose `args` say the phase
  and the edge: {"phase": "forward", "edge": "start"|"end"}. A peak that rose between two
  marks rose in the phase open between them. The user's peak statistics are never reset.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import weakref
from typing import Any

CAT = "memory"
# ru_maxrss is in KiB on Linux (bytes on macOS)
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024
PHASES = ("io", "h2d", "forward", "backward", "update")
_getrusage, _SELF = resource.getrusage, resource.RUSAGE_SELF


def _held_pread() -> Any:
    """pread(2) called with the GIL held (ctypes.PyDLL): os.pread lets it go, and on a
    phase boundary of the training thread the writer thread would take it and the job
    would wait for it back (up to the 5 ms switch interval). None where libc has none."""
    try:
        fn = ctypes.PyDLL(None, use_errno=True).pread
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long)
    fn.restype = ctypes.c_ssize_t

    def pread(fd: int, n: int, offset: int) -> bytes:
        buf = ctypes.create_string_buffer(128)    # each call its own: threads may read too
        got = fn(fd, buf, min(n, 128), offset)
        if got < 0:
            raise OSError(ctypes.get_errno(), "pread")
        return buf.raw[:got]
    return pread


_pread = _held_pread() or os.pread


def of_iteration(row: tuple[Any, ...]) -> bool:
    """A recorder row that goes with its iteration (`step`) as spans do: the memory read at
    a phase boundary (a recording window or ring keeps it only with its iteration's detail;
    the peaks, written only when they grow, are kept as every other sample)."""
    return row[1] == CAT and row[2] in _PER_ITERATION


_PER_ITERATION = frozenset(("rss", "cuda_allocated"))


def install(rec: Any) -> None:
    """Sample `rec`'s process at each of its flushes, and at its phases' boundaries."""
    rec.memory = PhaseMemory(rec)
    rec.flush_hooks.append(_Memory(rec, rec.memory).on_flush)


def _row(rec: Any, name: str, value: float, device: int, t_ns: int, step: int = -1,
         args: str | None = None) -> tuple[Any, ...]:
    return ("sample", CAT, name, t_ns, None, float(value), "B", rec.host, rec.rank, rec.pid,
            -1, device, -1, step, -1, None, None, None, None, args)


def _cuda() -> Any:
    """torch.cuda where the job's torch has initialized it (never initializes it)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return cuda if cuda is not None and cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a torch without it
        return None


class _Memory:
    def __init__(self, rec: Any, marks: PhaseMemory) -> None:
        self.rec = rec
        self.marks = marks
        self.last: dict[tuple[str, int], float] = {}

    def on_flush(self, spans: list[tuple[Any, ...]], final: bool) -> list[tuple[Any, ...]]:
        # a process that records nothing else (a helper subprocess) gets no shard for this
        if not spans and not self.rec.rows_written:
            return []
        now = {("rss_peak", -1): resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               * _RSS_UNIT}
        once: dict[tuple[str, int], float] = {}
        if ("host_total", -1) not in self.last:
            try:
                once["host_total", -1] = os.sysconf("SC_PHYS_PAGES") * \
                    os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError):
                once["host_total", -1] = 0
        cuda = _cuda()
        if cuda is not None and self.marks.cuda is None and not self.marks.cuda_off:
            self.marks.cuda = cuda    # the phases' marks read it from now on
        try:
            if cuda is not None:
                for dev in range(cuda.device_count()):
                    now["cuda_allocated_peak", dev] = cuda.max_memory_allocated(dev)
                    now["cuda_reserved_peak", dev] = cuda.max_memory_reserved(dev)
                    if ("cuda_total", dev) not in self.last and now["cuda_reserved_peak",
                                                                     dev] > 0:
                        once["cuda_total", dev] = \
                            cuda.get_device_properties(dev).total_memory
        except Exception:  # noqa: BLE001 - a torch without these: the RSS alone
            pass
        t = self.rec.now_ns()
        rows = [_row(self.rec, name, v, dev, t) for (name, dev), v in now.items()
                if v > self.last.get((name, dev), -1)]
        rows += [_row(self.rec, name, v, dev, t) for (name, dev), v in once.items() if v > 0]
        self.last.update(now)
        self.last.update(once)
        return rows


class PhaseMemory:
    """The memory at a phase's start and end, read on the training loop's thread: a pread
    of /proc/self/statm and a getrusage (a few us together), and on CUDA (from the first flush
    after the job initialized it) one read of the allocator's statistics. Rows go straight
    onto the recorder's queue."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.fd = -1           # /proc/self/statm of this process (a forked child reopens it)
        self.hwm = 0.0
        self.cuda_peak: dict[int, float] = {}
        self.cuda: Any = None
        self.cuda_off = False
        self.failed = False
        self.args = {(p, e): json.dumps({"phase": p, "edge": "end" if e else "start"},
                                        separators=(",", ":"))
                     for p in PHASES for e in (0, 1)}

        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forked(me()))

    def mark(self, phase: str, end: int, t_ns: int) -> None:
        """`phase` (one of PHASES) starts (end=0) or ends (end=1) at t_ns."""
        if self.failed:
            return
        try:
            if self.fd < 0:
                self.fd = os.open("/proc/self/statm", os.O_RDONLY)
            rss = float(int(_pread(self.fd, 128, 0).split()[1]) * self.page)
            hwm = float(_getrusage(_SELF).ru_maxrss * _RSS_UNIT)
        except (OSError, ValueError, IndexError):
            self.failed = True    # no /proc (macOS): the flush's peaks alone
            return
        rec = self.rec
        args = self.args[phase, end]
        push = rec._rows.append
        step = rec.step
        push(("sample", CAT, "rss", t_ns, None, rss, "B", rec.host, rec.rank, rec.pid, -1, -1,
              -1, step, -1, None, None, None, None, args))
        if hwm != self.hwm:
            self.hwm = hwm
            push(("sample", CAT, "rss_peak", t_ns, None, hwm, "B", rec.host, rec.rank, rec.pid,
                  -1, -1, -1, step, -1, None, None, None, None, args))
        cuda = self.cuda
        if cuda is None:
            return
        try:
            dev = cuda.current_device()
            stats = _allocated(cuda, dev)
        except Exception:  # noqa: BLE001 - the RSS alone from now on
            self.cuda, self.cuda_off = None, True
            return
        push(_row(rec, "cuda_allocated", stats[0], dev, t_ns, step, args))
        if stats[1] != self.cuda_peak.get(dev):
            self.cuda_peak[dev] = stats[1]
            push(_row(rec, "cuda_allocated_peak", stats[1], dev, t_ns, step, args))


def _forked(m: PhaseMemory | None) -> None:
    """In a forked child: its own /proc/self/statm (the inherited one is the parent's)."""
    if m is not None and m.fd >= 0:
        os.close(m.fd)
        m.fd = -1


def _allocated(cuda: Any, dev: int) -> tuple[float, float]:
    """The caching allocator's (current, peak) allocated bytes on `dev`: the nested
    statistics torch builds in C++ (memory_allocated() flattens and sorts all of them)."""
    get = getattr(getattr(sys.modules["torch"], "_C", None), "_cuda_memoryStats", None)
    if get is not None:
        a = get(dev)["allocated_bytes"]["all"]
        return float(a["current"]), float(a["peak"])
    return float(cuda.memory_allocated(dev)), float(cuda.max_memory_allocated(dev))
