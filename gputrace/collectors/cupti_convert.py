"""CUPTI activity records -> trace v1 rows (`Converter`), with phase and step attribution:
each GPU record belongs to the innermost gputrace phase that was open on the launching thread
when its launch call began (the runtime API record, matched by correlation id), or, when none
was open there, on the training loop's thread. Independent of CUPTI itself: it reads records
by attribute name, with kinds from the module given, so a fake record source or a dump of
real records drives the same code."""

from __future__ import annotations

import json
from collections import defaultdict, deque
from typing import Any

HOLD_FLUSHES = 3          # a record waits at most this many flushes for its phase to close
# A launch's GPU record comes in a later buffer than its API record when the GPU lags: an
# API record waits this many flushes for its GPU record (calls with none, e.g. cudaMalloc,
# are dropped then)
LAUNCH_KEEP_FLUSHES = 16


class Converter:
    """CUPTI activity records -> trace rows, with phase and step attribution."""

    def __init__(self, cupti: Any, *, host: str, rank: int, pid: int,
                 offset_ns: int = 0, threads: dict[int, int] | None = None) -> None:
        K = cupti.ActivityKind
        self.kind_kernel = {int(K.CONCURRENT_KERNEL), int(K.KERNEL)}
        self.kind_memcpy = {int(K.MEMCPY)}
        self.kind_memset = {int(K.MEMSET)}
        self.kind_api = {int(K.RUNTIME), int(K.DRIVER)}
        self.kind_sync = {int(K.SYNCHRONIZATION)}
        self.kind_marker = {int(K.MARKER)}
        M = cupti.ActivityMemoryKind
        self.mem = {int(M.PAGEABLE): "pageable", int(M.PINNED): "pinned",
                    int(M.DEVICE): "device", int(M.MANAGED): "managed"}
        for extra, name in (("DEVICE_STATIC", "device"), ("MANAGED_STATIC", "managed")):
            if hasattr(M, extra):
                self.mem[int(getattr(M, extra))] = name
        C = cupti.ActivityMemcpyKind
        self.copy = {int(v): n for n, v in C.__members__.items()}
        F = cupti.ActivityFlag
        self.flag_start = int(F.MARKER_START)
        self.flag_instant = int(F.MARKER_INSTANTANEOUS)
        self.host, self.rank, self.pid, self.offset = host, rank, pid, offset_ns
        # imported here, not at module level: the job imports this module when it imports
        # torch, and only needs numpy/pyarrow once CUPTI really runs
        from gputrace.importers import common

        self._common = common
        self.launch: dict[int, tuple[int, int]] = {}   # corr -> (CUPTI thread id, start)
        self._launch_age: deque[list[int]] = deque([[]])  # corrs, by the flush they came in
        self.pending: deque[tuple[int, Any]] = deque()          # (flush count, record)
        self.phases: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
        self.watermark: dict[int, int] = {}                     # thread -> last phase end
        self.iters: list[tuple[int, int, int]] = []
        # native TID -> low 32 bits of pthread_self (the recorder's, kept up to date by it)
        self.threads: dict[int, int] = threads if threads is not None else {}
        self._native: dict[int, int] = {}                       # its inverse
        self.loop_tid: int | None = None                        # the thread of iterations
        self.iter_mark = -1                                     # last iteration end seen
        self.markers: dict[int, tuple[str, int, str | None]] = {}
        self.flushes = 0
        self.counts: dict[str, int] = defaultdict(int)

    # -- inputs --------------------------------------------------------------------------------
    def add_spans(self, spans: list[tuple[Any, ...]]) -> None:
        """The recorder's drained spans: (cat, name, start, end, tid, step, layer, ...)."""
        for sp in spans:
            cat, _, s, e, tid, step = sp[:6]
            if cat == "iteration":
                self.iters.append((s, e, step))
                self.loop_tid = tid
                self.iter_mark = max(self.iter_mark, e)
            elif cat in self._common.PHASES:
                self.phases[tid].append((s, e, cat))
                if e > self.watermark.get(tid, 0):
                    self.watermark[tid] = e

    def feed(self, records: list[Any]) -> None:
        for r in records:
            k = int(r.kind)
            if k in self.kind_api:
                corr = int(r.correlation_id)
                self.launch[corr] = (int(r.thread_id), int(r.start) + self.offset)
                self._launch_age[-1].append(corr)
            else:
                self.pending.append((self.flushes, r))

    # -- conversion ----------------------------------------------------------------------------
    def native_tid(self, cupti_thread: int) -> int:
        """The native TID of a thread CUPTI names by its pthread id (itself if unknown)."""
        n = self._native.get(cupti_thread)
        if n is None:
            if len(self._native) != len(self.threads):
                self._native = {pt: tid for tid, pt in list(self.threads.items())}
                n = self._native.get(cupti_thread)
        return cupti_thread if n is None else n

    def _loop(self) -> int | None:
        if self.loop_tid is not None:
            return self.loop_tid
        if self.phases:
            return max(self.phases, key=lambda t: len(self.phases[t]))
        return None

    def drain(self, final: bool = False) -> list[tuple[Any, ...]]:
        """Rows for every record whose launching phase is known (or that waited long enough)."""
        self.flushes += 1
        ready: list[Any] = []
        keep: deque[tuple[int, Any]] = deque()
        loop = self._loop()
        for born, r in self.pending:
            corr = getattr(r, "correlation_id", None)
            launch = self.launch.get(int(corr)) if corr is not None else None
            # known once the ranges that could hold the launch have closed: the loop
            # thread's (which encloses the others' in time), else the launching thread's
            # (and the iteration holding it, for its step)
            settled = launch is not None and launch[1] <= min(self.iter_mark, self.watermark.get(
                loop if loop is not None else self.native_tid(launch[0]), -1))
            if final or settled or self.flushes - born >= HOLD_FLUSHES or \
                    int(r.kind) in self.kind_marker:
                ready.append(r)
            else:
                keep.append((born, r))
        self.pending = keep
        gpu = [r for r in ready if int(r.kind) not in self.kind_marker]
        rows = self._gpu_rows(gpu)
        rows.extend(self._marker_rows([r for r in ready if int(r.kind) in self.kind_marker]))
        for r in gpu:       # a launch makes one GPU record: its call is no longer needed
            corr = getattr(r, "correlation_id", None)
            if corr is not None:
                self.launch.pop(int(corr), None)
        self._forget()
        return rows

    def _attribution(self, records: list[Any]
                     ) -> tuple[list[str | None], list[int], list[int | None]]:
        phase: list[str | None] = [None] * len(records)
        step = [-1] * len(records)
        launched: list[int | None] = [None] * len(records)
        known = []
        for i, r in enumerate(records):
            corr = getattr(r, "correlation_id", None)
            la = self.launch.get(int(corr)) if corr is not None else None
            if la is not None:
                known.append((i, self.native_tid(la[0]), la[1]))
                launched[i] = la[1]
        if not known:
            return phase, step, launched
        phases = [(tid, s, e, c) for tid, lst in self.phases.items() for s, e, c in lst]
        loop = self._loop()
        keys = [k for _, k, _ in known]
        fallback = {k: loop for k in set(keys) if loop is not None and k != loop}
        ph, st = self._common.launch_context(phases, self.iters, keys,
                                             [t for _, _, t in known], fallback)
        for (i, _, _), p, k in zip(known, ph, st, strict=True):
            phase[i], step[i] = p, int(k)
        return phase, step, launched

    def _gpu_rows(self, records: list[Any]) -> list[tuple[Any, ...]]:
        phase, step, launched = self._attribution(records)
        h, rank, pid, off = self.host, self.rank, self.pid, self.offset
        rows = []
        for r, ph, st, la in zip(records, phase, step, launched, strict=True):
            k = int(r.kind)
            s, e = int(r.start) + off, int(r.end) + off
            dev = int(getattr(r, "device_id", -1))
            stream = int(getattr(r, "stream_id", -1))
            corr = int(getattr(r, "correlation_id", 0)) or None
            if k in self.kind_kernel:
                name = str(r.name)
                nccl = self._common.is_nccl(name)
                self.counts["comm" if nccl else "kernel"] += 1
                rows.append(("span", "comm" if nccl else "kernel", name, s, e, None, None, h,
                             rank, pid, -1, dev, stream, st, -1, None, None, None, corr, None,
                             "comm" if nccl else ph, la))
            elif k in self.kind_memcpy:
                kind = self.copy.get(int(r.copy_kind), "UNKNOWN")
                src, dst = self.mem.get(int(r.src_kind)), self.mem.get(int(r.dst_kind))
                if ph is None and dst == "device" and src in ("pageable", "pinned"):
                    ph = "h2d"       # the batch's copy to the GPU, made outside any phase
                self.counts["memcpy"] += 1
                rows.append(("span", "memcpy", f"Memcpy {kind}", s, e, None, None, h, rank,
                             pid, -1, dev, stream, st, -1, int(r.bytes), src, dst, corr, None,
                             ph, la))
            elif k in self.kind_memset:
                self.counts["memset"] += 1
                rows.append(("span", "memset", "Memset", s, e, None, None, h, rank, pid, -1,
                             dev, stream, st, -1, int(r.bytes), None, None, corr, None, ph, la))
            elif k in self.kind_sync:
                self.counts["sync"] += 1
                rows.append(("span", "sync", "synchronize", s, e, None, None, h, rank, pid,
                             -1, -1, stream if stream < 2**31 else -1, st, -1, None, None,
                             None, corr, None, None, la))
        return rows

    def _marker_rows(self, records: list[Any]) -> list[tuple[Any, ...]]:
        """NVTX ranges of the user's own code (gputrace's domain is recorded already)."""
        rows = []
        h, rank, pid, off = self.host, self.rank, self.pid, self.offset
        for r in records:
            flags = int(getattr(r, "flags_", getattr(r, "flags", 0)))
            ts = int(r.timestamp) + off
            domain = str(r.domain) if getattr(r, "domain", None) else None
            if domain == "gputrace":
                continue
            if flags & self.flag_instant:
                rows.append(("instant", "user", str(r.name), ts, None, None, None, h, rank,
                             pid, -1, -1, -1, -1, -1, None, None, None, None,
                             json.dumps({"domain": domain}) if domain else None, None, None))
            elif flags & self.flag_start:
                self.markers[int(r.id)] = (str(r.name), ts, domain)
            elif int(r.id) in self.markers:
                name, start, domain = self.markers.pop(int(r.id))
                self.counts["nvtx"] += 1
                rows.append(("span", "user", name, start, ts, None, None, h, rank, pid, -1,
                             -1, -1, -1, -1, None, None, None, None,
                             json.dumps({"domain": domain}) if domain else None, None, None))
        return rows

    def _forget(self) -> None:
        """Drop launch and phase history no record can need any more."""
        self._launch_age.append([])
        while len(self._launch_age) > LAUNCH_KEEP_FLUSHES:
            for corr in self._launch_age.popleft():
                self.launch.pop(corr, None)
        # ranges older than any launch still waiting for its GPU record
        oldest = min((t for _, t in self.launch.values()), default=None) if self.launch \
            else None
        for tid, lst in self.phases.items():
            if len(lst) > 256:
                cut = len(lst) - 256
                if oldest is not None:   # ranges are appended as they close, ends in order
                    while cut > 0 and lst[cut - 1][1] >= oldest:
                        cut -= 1
                self.phases[tid] = lst[cut:]
        if len(self.iters) > 64:
            cut = len(self.iters) - 64
            if oldest is not None:
                while cut > 0 and self.iters[cut - 1][1] >= oldest:
                    cut -= 1
            self.iters = self.iters[cut:]
