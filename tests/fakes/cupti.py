"""A CUPTI record source shaped like cupti-python's `cupti.cupti` module, for CPU tests.

Kinds and enums carry the same names as cupti-python's; records are plain objects with the
attribute names of ActivityKernel10 / ActivityMemcpy6 / ActivityMemset4 / ActivityAPI /
ActivityMarker2 / ActivitySynchronization. `activity_flush_all` hands the queued records
to the registered completion callback, as CUPTI's own thread would.

What the records carry is what a real GPU gives (seen on an H100 with CUDA 13 and
cupti-python 13.4): a runtime API record names its thread by the low 32 bits of
pthread_self (0xa246b140 for a thread whose native TID was 419), not by the native TID;
correlation ids come from one counter for the whole process, so threads that launch at the
same time interleave them; a GPU record's times are when the device ran it, which, with
launches queued ahead, is long after the host made the call (an iteration or more). A
pageable host-to-device copy holds the calling thread until it is done (7.8 GB/s on that
machine's PCIe gen5), a pinned one does not (55 GB/s). `FakeDevice` plays those rules out in
real time for a loop that launches work through it.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from types import SimpleNamespace


class ActivityKind(enum.IntEnum):
    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    MARKER = 12
    SYNCHRONIZATION = 38


class ActivityMemoryKind(enum.IntEnum):
    UNKNOWN = 0
    PAGEABLE = 1
    PINNED = 2
    DEVICE = 3
    ARRAY = 4
    MANAGED = 5
    DEVICE_STATIC = 6
    MANAGED_STATIC = 7


class ActivityMemcpyKind(enum.IntEnum):
    UNKNOWN = 0
    HTOD = 1
    DTOH = 2
    DTOD = 8
    PTOP = 10


class ActivityFlag(enum.IntEnum):
    NONE = 0
    MARKER_INSTANTANEOUS = 1
    MARKER_START = 2
    MARKER_END = 4


class FakeCupti:
    """Module-like: the functions gputrace calls, and helpers to make records."""

    ActivityKind = ActivityKind
    ActivityMemoryKind = ActivityMemoryKind
    ActivityMemcpyKind = ActivityMemcpyKind
    ActivityFlag = ActivityFlag

    def __init__(self, clock_offset_ns: int = 0) -> None:
        self.enabled: set[int] = set()
        self.queued: list[object] = []
        self.completed = None
        self.offset = clock_offset_ns
        self.corr = 0
        self._ids = itertools.count(1)      # one counter for every thread, as CUPTI's
        self.threads_seen: set[int] = set()
        self._lock = threading.Lock()

    # -- the API --------------------------------------------------------------------------
    def get_timestamp(self) -> int:
        return time.time_ns() - self.offset

    def activity_register_callbacks(self, requested, completed) -> None:
        size, _ = requested()
        assert size > 0
        self.completed = completed

    def activity_enable(self, kind) -> None:
        self.enabled.add(int(kind))

    def activity_disable(self, kind) -> None:
        self.enabled.discard(int(kind))

    def activity_flush_all(self, flag: int) -> None:
        with self._lock:
            if not self.queued or self.completed is None:
                return
            batch, self.queued = self.queued, []
        self.completed(batch)

    def _put(self, rec: object) -> None:
        with self._lock:
            self.queued.append(rec)

    def activity_get_num_dropped_records(self, ctx: int, stream: int) -> int:
        return 0

    # -- records (times on the CUPTI clock) ---------------------------------------------------
    def launch(self, thread_id: int | None, t: int, kind=ActivityKind.RUNTIME,
               dur_ns: int = 1000) -> int:
        """A runtime API call at t (CUPTI clock) on a thread; None: the calling thread, named
        as CUPTI names it (low 32 bits of its pthread_self)."""
        if thread_id is None:
            thread_id = pthread_id()
        self.threads_seen.add(thread_id)
        corr = next(self._ids)
        self.corr = corr
        self._put(SimpleNamespace(kind=int(kind), correlation_id=corr, thread_id=thread_id,
                                  process_id=1, start=t, end=t + dur_ns, cbid=211))
        return corr

    def kernel(self, corr: int, name: str, start: int, end: int, device: int = 0,
               stream: int = 7) -> None:
        self._put(SimpleNamespace(kind=int(ActivityKind.CONCURRENT_KERNEL), name=name,
                                           start=start, end=end, correlation_id=corr,
                                           device_id=device, stream_id=stream))

    def memcpy(self, corr: int, start: int, end: int, nbytes: int, copy_kind, src, dst,
               device: int = 0, stream: int = 7) -> None:
        self._put(SimpleNamespace(kind=int(ActivityKind.MEMCPY), start=start, end=end,
                                           bytes=nbytes, copy_kind=int(copy_kind),
                                           src_kind=int(src), dst_kind=int(dst),
                                           correlation_id=corr, device_id=device,
                                           stream_id=stream))

    def memset(self, corr: int, start: int, end: int, nbytes: int) -> None:
        self._put(SimpleNamespace(kind=int(ActivityKind.MEMSET), start=start, end=end,
                                           bytes=nbytes, correlation_id=corr, device_id=0,
                                           stream_id=7, memory_kind=int(ActivityMemoryKind.DEVICE)))

    def marker(self, mid: int, name: str, t: int, flags, domain: str | None = None) -> None:
        self._put(SimpleNamespace(kind=int(ActivityKind.MARKER), id=mid, name=name,
                                           timestamp=t, flags_=int(flags), domain=domain))

    def sync(self, corr: int, start: int, end: int) -> None:
        self._put(SimpleNamespace(kind=int(ActivityKind.SYNCHRONIZATION), start=start, end=end,
                                  correlation_id=corr, stream_id=2**32 - 1, type=3))


def pthread_id() -> int:
    """How CUPTI names the calling thread: the low 32 bits of its pthread_self."""
    return threading.get_ident() & 0xFFFFFFFF


PAGEABLE_BYTES_PER_S = 7.8e9     # H2D on an H100, PCIe gen5, as CUPTI measured it
PINNED_BYTES_PER_S = 55e9


class FakeDevice:
    """A GPU played out in real time: work launched through it is queued per stream and
    runs back to back on the device clock, records appear as CUPTI gives them.

    The host only waits where a real one does: `synchronize`, a pageable copy, and a full
    launch queue. Truth for tests: `ran` holds (phase label, start, end) of every record on
    the device, as the loop labelled its launches."""

    def __init__(self, cupti: FakeCupti, launch_latency_ns: int = 5_000,
                 queue_depth: int = 1024) -> None:
        self.cu = cupti
        self.latency = launch_latency_ns
        self.depth = queue_depth
        self.free: dict[int, int] = {}            # stream -> device time it is idle again
        self.queue: list[int] = []                # ends of launched, unfinished work
        self.ran: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def now(self) -> int:
        return self.cu.get_timestamp()

    def _wait_until(self, t: int) -> None:
        """Hold the host until device time t, as a blocking CUDA call returns: promptly
        (sleeps overshoot by 0.1 ms or more: the last stretch spins)."""
        while True:
            d = t - self.now()
            if d <= 0:
                return
            if d > 300_000:
                time.sleep((d - 200_000) / 1e9)

    def _enqueue(self, label: str, dur_ns: int, stream: int, after: int = 0
                 ) -> tuple[int, int, int]:
        t = self.now()
        with self.lock:
            self.queue = [e for e in self.queue if e > t]
            wait = self.queue[0] if len(self.queue) >= self.depth else 0
        if wait:                                   # the launch queue is full: the host waits
            self._wait_until(wait)
            t = self.now()
        corr = self.cu.launch(None, t)
        with self.lock:
            start = max(t + self.latency, self.free.get(stream, 0), after)
            end = start + dur_ns
            self.free[stream] = end
            self.queue.append(end)
            self.queue.sort()
            self.ran.append((label, start, end))
        return corr, start, end

    def kernel(self, name: str, dur_ns: int, label: str = "", stream: int = 7,
               after: int = 0) -> int:
        """Launch a kernel; returns its end on the device clock. `after`: it waits for
        that device time too (an event recorded on another stream)."""
        corr, start, end = self._enqueue(label, dur_ns, stream, after)
        self.cu.kernel(corr, name, start, end, stream=stream)
        return end

    def h2d(self, nbytes: int, pinned: bool, label: str = "", stream: int = 7,
            events: list[tuple[int, int]] | None = None) -> int:
        """A copy to the device; `events` gets (start, end) of CUDA events recorded right
        before and after the call (what a loop timing its copy would read; the host returns
        from the call when the copy is done, or at once for a pinned one)."""
        bw = PINNED_BYTES_PER_S if pinned else PAGEABLE_BYTES_PER_S
        e0 = self.event(stream)
        corr, start, end = self._enqueue(label, int(nbytes / bw * 1e9), stream)
        self.cu.memcpy(corr, start, end, nbytes, ActivityMemcpyKind.HTOD,
                       ActivityMemoryKind.PINNED if pinned else ActivityMemoryKind.PAGEABLE,
                       ActivityMemoryKind.DEVICE, stream=stream)
        if not pinned:                             # pageable: staged, the caller waits
            self._wait_until(end)
        if events is not None:
            # the event after the call completes when the stream has run the copy (a host
            # preempted on this shared machine between the call's return and the event
            # would otherwise put its wait into the truth)
            events.append((e0, end))
        return end

    def synchronize(self) -> None:
        t = self.now()
        corr = self.cu.launch(None, t)
        with self.lock:
            until = max(self.free.values(), default=t)
        self._wait_until(until)
        self.cu.sync(corr, t, max(until, self.now()))

    def event(self, stream: int = 7) -> int:
        """cudaEventRecord now: the device time the event completes (when the stream
        reaches it), as cudaEventElapsedTime reads it."""
        t = self.now()
        with self.lock:
            return max(t + self.latency, self.free.get(stream, 0))

    def wait_for(self, other: int, stream: int = 7) -> None:
        """cudaStreamWaitEvent: `stream` goes on once `other` has run what it was given."""
        with self.lock:
            self.free[stream] = max(self.free.get(stream, 0), self.free.get(other, 0))
