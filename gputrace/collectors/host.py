"""Host collector (psutil): storage vs page-cache reads of the traced process tree, disks,
NICs and CPU. Counters are cumulative; processes that exit keep their last values so the
tree's totals never go backwards."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import psutil

from gputrace.collectors import Unavailable
from gputrace.trace.writer import Row

# Block devices that are not storage a dataset is read from.
_SKIP_DISK = re.compile(r"^(loop|ram|zram|sr|fd)\d*")

_PROC_FIELDS = ("read_bytes", "write_bytes", "read_chars", "write_chars")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class _HeldFiles:
    """/proc files held open (Linux) and read with one pread each per sample, not psutil's
    opens and parsing; none is left open when one cannot be opened."""

    def __init__(self, *paths: str) -> None:
        self.fds: list[int] = []
        try:
            for path in paths:
                self.fds.append(os.open(path, os.O_RDONLY))
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


class _ProcFiles(_HeldFiles):
    """A process's /proc/<pid>/io and /proc/<pid>/stat. An open /proc file stays bound to
    its process, so a reused pid can never be read in its place."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"/proc/{pid}/io", f"/proc/{pid}/stat")
        try:    # its main thread's time runnable and waiting for a CPU (CONFIG_SCHED_INFO)
            self.fds.append(os.open(f"/proc/{pid}/schedstat", os.O_RDONLY))
        except OSError:
            pass

    def read(self) -> tuple[float, ...]:
        """(read_bytes, write_bytes, read_chars, write_chars, cpu seconds, run-queue wait
        seconds or 0); OSError once the process is gone."""
        io = dict(line.split(b": ") for line in os.pread(self.fds[0], 512, 0).splitlines())
        stat = os.pread(self.fds[1], 1024, 0)
        f = stat[stat.rindex(b")") + 2:].split()   # fields from the 3rd (state) on
        wait = int(os.pread(self.fds[2], 128, 0).split()[1]) / 1e9 if len(self.fds) > 2 \
            else 0.0
        return (float(io[b"read_bytes"]), float(io[b"write_bytes"]), float(io[b"rchar"]),
                float(io[b"wchar"]), (int(f[11]) + int(f[12])) / _TICK,  # utime + stime
                wait)


def _pread_all(fd: int, size: int) -> bytes:
    """A whole /proc file from one open descriptor (a larger read where it was cut off)."""
    while True:
        data = os.pread(fd, size, 0)
        if len(data) < size:
            return data
        size *= 4


class _SystemFiles(_HeldFiles):
    """/proc/stat, /proc/diskstats and /proc/net/dev (machine-wide counters through psutil
    were most of a sample's cost). Values are what psutil gives: disk bytes as 512-byte
    sectors, NIC byte counters, CPU busy % over the interval."""

    def __init__(self) -> None:
        super().__init__("/proc/stat", "/proc/diskstats", "/proc/net/dev")
        self._cpu: tuple[int, int] | None = None
        try:
            self.cpu_percent()      # checks that each reads as expected
            self.disks()
            self.nics()
        except (OSError, ValueError, IndexError):
            self.close()
            raise

    def cpu_percent(self) -> float:
        f = os.pread(self.fds[0], 256, 0).split(b"\n", 1)[0].split()
        ticks = [int(x) for x in f[1:9]]       # user nice system idle iowait irq softirq steal
        total, idle = sum(ticks), ticks[3] + ticks[4]
        prev, self._cpu = self._cpu, (total, idle)
        if prev is None or total <= prev[0]:
            return 0.0
        return 100.0 * (1.0 - (idle - prev[1]) / (total - prev[0]))

    def disks(self) -> list[tuple[str, float, float]]:
        out = []
        for line in _pread_all(self.fds[1], 16384).splitlines():
            f = line.split()
            if len(f) >= 14:
                out.append((f[2].decode(), int(f[5]) * 512.0, int(f[9]) * 512.0))
            elif len(f) == 7:                   # a partition on old kernels
                out.append((f[2].decode(), int(f[4]) * 512.0, int(f[6]) * 512.0))
        return out

    def nics(self) -> list[tuple[str, float, float]]:
        out = []
        for line in _pread_all(self.fds[2], 8192).splitlines()[2:]:
            name, _, rest = line.partition(b":")
            f = rest.split()
            out.append((name.strip().decode(), float(f[8]), float(f[0])))   # sent, received
        return out


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _descendants(root: int) -> list[int]:
    """root and every process below it, from /proc/<pid>/task/<tid>/children: a few small
    reads per process of the tree, where psutil's children() reads every process on the
    machine (a GPU node runs hundreds)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:   # gone
            continue
        for tid in tids:
            try:
                todo.extend(int(x) for x in _read(f"/proc/{pid}/task/{tid}/children").split())
            except OSError:
                continue
    return out


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


class _PsutilSystem:
    """The same counters through psutil, where there is no /proc."""

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)   # prime the machine-wide counter

    def cpu_percent(self) -> float:
        return psutil.cpu_percent(interval=None)

    def disks(self) -> list[tuple[str, float, float]]:
        return [(d, float(c.read_bytes), float(c.write_bytes))
                for d, c in (psutil.disk_io_counters(perdisk=True) or {}).items()]

    def nics(self) -> list[tuple[str, float, float]]:
        return [(n, float(c.bytes_sent), float(c.bytes_recv))
                for n, c in (psutil.net_io_counters(pernic=True) or {}).items()]

    def close(self) -> None:
        pass


class HostCollector:
    name = "host"

    # the tree's processes are looked for 4 times a second, not every sample; one found late
    # still brings its whole count
    def __init__(self, root_pid: int, host: str, tree_refresh_s: float = 0.25) -> None:
        try:
            self.root = psutil.Process(root_pid)
            self.root.io_counters()
        except psutil.NoSuchProcess:
            raise Unavailable(f"process {root_pid} does not exist") from None
        except (psutil.AccessDenied, AttributeError) as e:
            raise Unavailable(f"per-process I/O counters not readable here ({e})") from None
        self.root_pid = root_pid
        self.host = host
        self.tree_refresh_s = tree_refresh_s
        self._procs: dict[tuple[int, float], psutil.Process] = {}
        self._files: dict[tuple[int, float], _ProcFiles | None] = {}   # None: use psutil
        self._last: dict[tuple[int, float], tuple[float, ...]] = {}
        # read_bytes, write_bytes, read_chars, write_chars, cpu_s, run-queue wait s
        self._dead = [0.0] * 6
        self.has_wait = os.path.exists(f"/proc/{root_pid}/schedstat")
        self._tree_t = -1.0
        # Linux with CONFIG_PROC_CHILDREN (the usual kernels): the tree is walked from its root
        self._proc_children = os.path.exists(f"/proc/{root_pid}/task/{root_pid}/children")
        self._cpu_prev: tuple[float, float] | None = None
        self.max_procs = 0
        try:
            self.system: _SystemFiles | _PsutilSystem = _SystemFiles()
        except (OSError, ValueError, IndexError):   # no /proc, or not laid out as Linux's
            self.system = _PsutilSystem()
        self.has_disks = bool(self.system.disks())
        self.has_nics = bool(self.system.nics())

    def settings(self) -> dict[str, Any]:
        return {"root_pid": self.root_pid, "tree_refresh_s": self.tree_refresh_s,
                "disks": self.has_disks, "nics": self.has_nics}

    def _refresh_tree(self) -> None:
        if self._proc_children:
            known = {key[0]: p for key, p in self._procs.items()}
            found = [known[pid] if pid in known else _process(pid)
                     for pid in _descendants(self.root_pid)]
        else:   # psutil finds children by reading every process on the machine
            try:
                found = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                found = []
        seen = {}
        for p in found:
            if p is None:
                continue
            try:
                seen[(p.pid, p.create_time())] = p   # psutil keeps a Process's create time
            except psutil.NoSuchProcess:
                continue
        for key in list(self._procs):
            if key not in seen:
                self._retire(key)
        self._procs.update(seen)
        self.max_procs = max(self.max_procs, len(self._procs))

    def _retire(self, key: tuple[int, float]) -> None:
        self._procs.pop(key, None)
        files = self._files.pop(key, None)
        if files is not None:
            files.close()
        last = self._last.pop(key, None)
        if last is not None:
            for i, v in enumerate(last):
                self._dead[i] += v

    def _tree_totals(self) -> list[float]:
        now = time.monotonic()
        if now - self._tree_t >= self.tree_refresh_s:
            self._tree_t = now
            self._refresh_tree()
        totals = list(self._dead)
        for key, p in list(self._procs.items()):
            if key not in self._files:
                try:
                    self._files[key] = _ProcFiles(key[0])
                except (OSError, AttributeError):   # no /proc (or no pread) here
                    self._files[key] = None
            files = self._files[key]
            try:
                if files is not None:
                    vals = files.read()
                else:
                    with p.oneshot():
                        io = p.io_counters()
                        ct = p.cpu_times()
                    vals = (float(io.read_bytes), float(io.write_bytes),
                            float(getattr(io, "read_chars", io.read_bytes)),
                            float(getattr(io, "write_chars", io.write_bytes)),
                            ct.user + ct.system,  # children_* would count exited ones twice
                            0.0)
            except (OSError, ValueError, KeyError, IndexError,
                    psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                self._retire(key)
                continue
            self._last[key] = vals
            for i, v in enumerate(vals):
                totals[i] += v
        return totals

    def sample(self, t_ns: int) -> list[Row]:
        h, pid = self.host, self.root_pid
        rows: list[Row] = []

        def add(cat: str, name: str, value: float, unit: str) -> None:
            rows.append(("sample", cat, name, t_ns, None, value, unit, h, -1, pid, -1, -1, -1,
                         -1, -1, None, None, None, None, None))

        totals = self._tree_totals()
        for i, f in enumerate(_PROC_FIELDS):
            add("host", f"proc.{f}", totals[i], "bytes")
        wall = time.monotonic()
        if self._cpu_prev is not None and wall > self._cpu_prev[0]:
            pct = 100.0 * (totals[4] - self._cpu_prev[1]) / (wall - self._cpu_prev[0])
            add("cpu", "proc.cpu_percent", max(pct, 0.0), "%")
        self._cpu_prev = (wall, totals[4])
        if self.has_wait:   # cumulative: the tree's time runnable and not running
            add("cpu", "proc.run_wait_s", totals[5], "s")
        add("cpu", "cpu.percent", self.system.cpu_percent(), "%")
        if self.has_disks:
            for dev, read, written in self.system.disks():
                if _SKIP_DISK.match(dev):
                    continue
                add("disk", f"disk.{dev}.read_bytes", read, "bytes")
                add("disk", f"disk.{dev}.write_bytes", written, "bytes")
        if self.has_nics:
            for nic, sent, received in self.system.nics():
                add("net", f"net.{nic}.sent_bytes", sent, "bytes")
                add("net", f"net.{nic}.recv_bytes", received, "bytes")
        return rows

    def close(self) -> None:
        for key in list(self._files):
            self._retire(key)
        self.system.close()
