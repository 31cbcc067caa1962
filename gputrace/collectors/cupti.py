"""CUPTI activity collector (cupti-python): kernels, memcpy, memset, sync, NVTX markers.

In the training process. CUPTI hands over filled buffers on its own thread; the callback only
queues them. The recorder's flusher (every 0.8 s) asks CUPTI to flush, converts the queued
records into trace rows and attributes each GPU record to the innermost gputrace phase that
was open on the launching thread when the launch call began (runtime API record, matched by
correlation id), or, when none was open there, on the training loop's thread (autograd's
device threads launch the backward while the loop waits in it). CUPTI names the launching
thread by the low 32 bits of its pthread_self, not by its native TID: the recorder's map of
the two (`Recorder.threads`) joins them. NCCL kernels become `comm` spans; a host-to-device
copy launched in no phase is `h2d`. Each row keeps its launch time (`launch_ns`): it belongs
to the iteration of its launch, wherever it ran.

The conversion (`Converter`, in `cupti_convert`) is independent of CUPTI itself: it reads
records by attribute name, with kinds from the module given, so a fake record source drives
the same code.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import sys
import time
from collections import deque
from typing import Any

from gputrace.collectors.cupti_convert import Converter
from gputrace.collectors.gate import WindowGate

HELD_ELSEWHERE = "(another profiler, e.g. torch.profiler or nsys, holds CUPTI)"


def availability() -> str:
    """'ok', or 'unavailable: <one-line reason>'. A machine without NVIDIA's driver is told
    so, not to install the gpu extra, which would not help it."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "unavailable: no CUDA driver (libcuda.so.1) on this machine"
    if importlib.util.find_spec("cupti") is None:
        return "unavailable: cupti-python is not installed (pip install 'gputrace[gpu]')"
    return "ok"


# what the converter reads of a record: a dump keeps these, as CUPTI gave them
RECORD_FIELDS = ("kind", "correlation_id", "thread_id", "process_id", "start", "end", "name",
                 "device_id", "stream_id", "bytes", "copy_kind", "src_kind", "dst_kind",
                 "flags", "flags_", "timestamp", "id", "domain", "cbid")


class Dump:
    """GPUTRACE_CUPTI_DUMP=PATH: every flush's spans and CUPTI records, as the collector
    received them, one JSON line each (gzip), with the thread map and the enums' values:
    real records to replay through the same conversion on a machine without a GPU."""

    def __init__(self, path: str, cupti: Any, threads: dict[int, int], offset: int) -> None:
        import gzip

        self.f = gzip.open(path, "wt")
        self.threads = threads
        enums = {e: {n: int(v) for n, v in getattr(cupti, e).__members__.items()}
                 for e in ("ActivityKind", "ActivityMemoryKind", "ActivityMemcpyKind",
                           "ActivityFlag") if hasattr(cupti, e)}
        self._line({"enums": enums, "clock_offset_ns": offset, "pid": os.getpid()})

    def _line(self, obj: dict[str, Any]) -> None:
        self.f.write(json.dumps(obj, default=str) + "\n")

    def write(self, spans: list[tuple[Any, ...]], batches: list[list[Any]], final: bool) -> None:
        def fields(r: Any) -> dict[str, Any]:
            out = {}
            for k in RECORD_FIELDS:
                v = getattr(r, k, None)
                if v is not None:
                    out[k] = v if isinstance(v, (int, float, str)) else int(v) \
                        if hasattr(v, "__int__") else str(v)
            return out

        self._line({"spans": [list(sp) for sp in spans], "threads": dict(self.threads),
                    "batches": [[fields(r) for r in b] for b in batches], "final": final})
        if final:
            self.f.close()


class CuptiCollector(WindowGate):
    """Subscribes to CUPTI activity in this process and feeds the recorder's flusher."""

    name = label = "cupti"

    def __init__(self, recorder: Any, cupti: Any | None = None) -> None:
        if cupti is None:
            from cupti import cupti as real  # type: ignore[import-not-found]

            cupti = real
        self.cupti = cupti
        self.recorder = recorder
        self.queue: deque[list[Any]] = deque()
        now = time.time_ns()
        ts = int(cupti.get_timestamp())
        # CUPTI's timestamps are CLOCK_REALTIME ns on Linux; convert only if they are not
        offset = now - ts if abs(now - ts) > 1_000_000_000 else 0
        self.converter = Converter(cupti, host=recorder.host, rank=recorder.rank,
                                   pid=recorder.pid, offset_ns=offset,
                                   threads=recorder.threads)
        self.kinds: list[Any] = []
        path = os.environ.get("GPUTRACE_CUPTI_DUMP")
        self.dump = Dump(path, cupti, recorder.threads, offset) if path else None

    def start(self) -> None:
        c = self.cupti
        K = c.ActivityKind

        def requested() -> tuple[int, int]:
            return 8 * 1024 * 1024, 0

        def completed(activities: list[Any]) -> None:
            self.queue.append(list(activities))

        c.activity_register_callbacks(requested, completed)
        for k in (K.CONCURRENT_KERNEL, K.MEMCPY, K.MEMSET, K.RUNTIME, K.DRIVER,
                  K.SYNCHRONIZATION, K.MARKER):
            c.activity_enable(k)
            self.kinds.append(k)
        self.recorder.flush_hooks.append(self.on_flush)
        self.watch_window()
        self.recorder.set_collector("cupti", "ok", source="cupti",
                                    clock_offset_ns=self.converter.offset,
                                    kinds=[getattr(k, "name", str(k)) for k in self.kinds])

    def _switch(self, on: bool) -> None:
        for k in self.kinds:
            (self.cupti.activity_enable if on else self.cupti.activity_disable)(k)

    def on_flush(self, spans: list[tuple[Any, ...]], final: bool) -> list[tuple[Any, ...]]:
        self.cupti.activity_flush_all(1 if final else 0)
        conv = self.converter
        conv.add_spans(spans)
        batches = []
        while self.queue:
            batches.append(self.queue.popleft())
            conv.feed(batches[-1])
        if self.dump is not None:
            self.dump.write(spans, batches, final)
        rows = conv.drain(final)
        if final:
            rows.append(self.stop())
        return rows

    def stop(self) -> tuple[Any, ...]:
        """Disable CUPTI; return a `cupti.summary` instant row with the record counts."""
        for k in self.kinds:
            try:
                self.cupti.activity_disable(k)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        self.kinds = []
        dropped = 0
        try:
            dropped = int(self.cupti.activity_get_num_dropped_records(0, 0))
        except Exception:  # noqa: BLE001
            pass
        r = self.recorder
        args = json.dumps({"records": dict(self.converter.counts), "dropped": dropped,
                           "window_switches": self.switches})
        return ("instant", "user", "cupti.summary", r.now_ns(), None, None, None, r.host,
                r.rank, r.pid, -1, -1, -1, -1, -1, None, None, None, None, args, None)


def start(recorder: Any, quiet: bool = False) -> CuptiCollector | None:
    """Start CUPTI in this process if it can run; otherwise say why in one line (unless
    `quiet`: a fallback is tried next) and go on. The reason is the collector's status."""
    status = availability()
    if status != "ok":
        recorder.set_collector("cupti", status)
        return None
    try:
        col = CuptiCollector(recorder)
        col.start()
        return col
    except Exception as e:  # noqa: BLE001 - CUPTI taken by another tool, CUDA mismatch, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "MULTIPLE_SUBSCRIBERS" in reason.upper() or "subscriber" in reason.lower():
            reason += f" {HELD_ELSEWHERE}"
        recorder.set_collector("cupti", f"unavailable: {reason}")
        if not quiet:
            print(f"gputrace: cupti: unavailable: {reason}; GPU kernels are not recorded",
                  file=sys.stderr)
        return None
