"""A CUPTI record source shaped like cupti-python's `cupti.cupti` module, for CPU tests.

Kinds and enums carry the same names as cupti-python's; records are plain objects with the
attribute names of ActivityKernel10 / ActivityMemcpy6 / ActivityMemset4 / ActivityAPI /
ActivityMarker2 / ActivitySynchronization. `activity_flush_all` hands the queued records
to the registered completion callback, as CUPTI's own thread would.
"""

from __future__ import annotations

import enum
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
        if self.queued and self.completed is not None:
            batch, self.queued = self.queued, []
            self.completed(batch)

    def activity_get_num_dropped_records(self, ctx: int, stream: int) -> int:
        return 0

    # -- records (times on the CUPTI clock) ---------------------------------------------------
    def launch(self, thread_id: int, t: int, kind=ActivityKind.RUNTIME) -> int:
        self.corr += 1
        self.queued.append(SimpleNamespace(kind=int(kind), correlation_id=self.corr,
                                           thread_id=thread_id, process_id=1, start=t,
                                           end=t + 1000, cbid=211))
        return self.corr

    def kernel(self, corr: int, name: str, start: int, end: int, device: int = 0,
               stream: int = 7) -> None:
        self.queued.append(SimpleNamespace(kind=int(ActivityKind.CONCURRENT_KERNEL), name=name,
                                           start=start, end=end, correlation_id=corr,
                                           device_id=device, stream_id=stream))

    def memcpy(self, corr: int, start: int, end: int, nbytes: int, copy_kind, src, dst,
               device: int = 0, stream: int = 7) -> None:
        self.queued.append(SimpleNamespace(kind=int(ActivityKind.MEMCPY), start=start, end=end,
                                           bytes=nbytes, copy_kind=int(copy_kind),
                                           src_kind=int(src), dst_kind=int(dst),
                                           correlation_id=corr, device_id=device,
                                           stream_id=stream))

    def memset(self, corr: int, start: int, end: int, nbytes: int) -> None:
        self.queued.append(SimpleNamespace(kind=int(ActivityKind.MEMSET), start=start, end=end,
                                           bytes=nbytes, correlation_id=corr, device_id=0,
                                           stream_id=7, memory_kind=int(ActivityMemoryKind.DEVICE)))

    def marker(self, mid: int, name: str, t: int, flags, domain: str | None = None) -> None:
        self.queued.append(SimpleNamespace(kind=int(ActivityKind.MARKER), id=mid, name=name,
                                           timestamp=t, flags_=int(flags), domain=domain))
