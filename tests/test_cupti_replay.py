"""CUPTI records from a real GPU replayed through the collector's conversion.

An Nsight Systems export holds the CUPTI activity records of its run as CUPTI gave them:
runtime API calls, kernels, copies and sets with their correlation ids and device times.
`../shared/data/nsys/h100_2gpu_1s.sqlite` is a 1 s window of a 2-GPU H100 job that ran far
ahead of its GPUs: a kernel started a median 0.42 s after its launch. Its records are fed to
the converter in the batches CUPTI would hand over (a record is delivered once it has
ended, a batch every 0.5 s), with its NVTX ranges as the phases open on the launching
thread, the thread named by a pthread-like id as CUPTI names it. Every GPU record must get
the phase an independent, brute-force reading of the same records gives, and its launch
time.
"""

from __future__ import annotations

import sqlite3
import zlib
from types import SimpleNamespace

import pytest

from gputrace.collectors.cupti_convert import Converter
from gputrace.recorder.core import Recorder
from tests.fakes.cupti import ActivityKind, FakeCupti

CATS = ("forward", "backward", "update", "h2d")


def cat_of(name: str) -> str:
    """A phase for each operator name: ranges of different phases nest in the file."""
    return CATS[zlib.crc32(name.split(",")[0].encode()) % len(CATS)]


def load_process(path: str):  # type: ignore[no-untyped-def]
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    pid = next(db.execute("SELECT globalTid >> 24 & 0xFFFFFF, COUNT(*) c FROM "
                          "CUPTI_ACTIVITY_KIND_RUNTIME GROUP BY 1 ORDER BY c DESC"))[0]
    strings = dict(db.execute("SELECT id, value FROM StringIds"))
    api = [SimpleNamespace(kind=int(ActivityKind.RUNTIME), start=s, end=e,
                           correlation_id=c, tid=g & 0xFFFFFF)
           for s, e, g, c in db.execute(
               "SELECT start, end, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME "
               "WHERE globalTid >> 24 & 0xFFFFFF = ?", (pid,))]
    gpu = [SimpleNamespace(kind=int(ActivityKind.CONCURRENT_KERNEL), start=s, end=e,
                           device_id=d, stream_id=st, correlation_id=c,
                           name=strings.get(n, "kernel"))
           for s, e, d, st, c, n in db.execute(
               "SELECT start, end, deviceId, streamId, correlationId, shortName FROM "
               "CUPTI_ACTIVITY_KIND_KERNEL WHERE globalPid >> 24 & 0xFFFFFF = ?", (pid,))]
    gpu += [SimpleNamespace(kind=int(ActivityKind.MEMCPY), start=s, end=e, device_id=d,
                            stream_id=st, correlation_id=c, bytes=b, copy_kind=k,
                            src_kind=sk + 1, dst_kind=dk + 1)      # nsys kinds from 0
            for s, e, d, st, c, b, k, sk, dk in db.execute(
                "SELECT start, end, deviceId, streamId, correlationId, bytes, copyKind, "
                "srcKind, dstKind FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                "WHERE globalPid >> 24 & 0xFFFFFF = ?", (pid,))]
    ranges = [(s, e, g & 0xFFFFFF, str(t if t is not None else strings.get(ti, "")))
              for s, e, g, t, ti in db.execute(
                  "SELECT start, end, globalTid, text, textId FROM NVTX_EVENTS WHERE "
                  "eventType IN (59, 60) AND end IS NOT NULL AND "
                  "globalTid >> 24 & 0xFFFFFF = ?", (pid,))]
    return api, gpu, ranges


def oracle(api, gpu, ranges):  # type: ignore[no-untyped-def]
    """By brute force: the innermost range open on the launching thread at the call."""
    call = {a.correlation_id: a for a in api}
    out = {}
    for r in gpu:
        a = call.get(r.correlation_id)
        best = None
        if a is not None:
            for s, e, tid, name in ranges:
                if tid == a.tid and s <= a.start <= e and (best is None or s > best[0] or
                                                         (s == best[0] and e < best[1])):
                    best = (s, e, name)
        ph = cat_of(best[2]) if best else None
        if ph is None and r.kind == int(ActivityKind.MEMCPY) and r.src_kind in (1, 2) and \
                r.dst_kind == 3:
            ph = "h2d"
        out[r.correlation_id, r.start] = (ph, a.start if a is not None else None)
    return out


@pytest.fixture
def records(shared_data):  # type: ignore[no-untyped-def]
    return load_process(str(shared_data / "nsys/h100_2gpu_1s.sqlite"))


def test_real_records_delivered_as_cupti_would_get_their_launch_phase(records):
    api, gpu, ranges = records
    lag = sorted(g.start - a.start for a in api for g in gpu
                 if g.correlation_id == a.correlation_id)
    assert lag[len(lag) // 2] > 100_000_000          # the GPU ran far behind its launches
    cu = FakeCupti()
    rec = Recorder("/nonexistent/unused.arrow", {"host": "h"})
    threads = {tid: (0x7F3A2000 + 0x1_0000 * i) & 0xFFFFFFFF
               for i, tid in enumerate(sorted({a.tid for a in api}))}
    rec.threads.update(threads)
    for a in api:
        a.thread_id = threads[a.tid]                  # as CUPTI names the thread
    conv = Converter(cu, host="h", rank=0, pid=1, threads=rec.threads)
    spans = sorted((e, (cat_of(name), name, s, e, tid, -1, -1, None, None))
                   for s, e, tid, name in ranges)
    events = sorted([(r.end, r) for r in api + gpu], key=lambda x: x[0])
    t0, t_end = events[0][0], events[-1][0]
    rows, i, j, flushes = [], 0, 0, 0
    t = t0
    while t <= t_end + 1_000_000_000:
        t += 500_000_000
        batch = []
        while i < len(events) and events[i][0] <= t:
            batch.append(events[i][1])
            i += 1
        closed = []
        while j < len(spans) and spans[j][0] <= t:
            closed.append(spans[j][1])
            j += 1
        conv.add_spans(closed)
        conv.feed(batch)
        rows += conv.drain()
        flushes += 1
    rows += conv.drain(final=True)
    assert flushes >= 3
    want = oracle(api, gpu, ranges)
    got = {(r[18], r[3]): (r[20], r[21]) for r in rows if r[1] in ("kernel", "memcpy", "comm")}
    assert len(got) == len(gpu) == len(want)
    wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    assert not wrong, list(wrong.items())[:5]
    assert sum(v[0] is not None for v in want.values()) > len(want) // 2
