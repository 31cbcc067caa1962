"""GPU records belong to the phase and iteration of their launch, checked on the CPU with a
device played out in real time (tests/fakes/cupti.py: records as a real GPU gives them:
pthread ids instead of native TIDs, correlation ids interleaved across threads, kernels that
run an iteration or more after the host launched them, pageable copies that hold the host).

The loop under test is a real multi-threaded Python loop recorded by the real recorder and
CUPTI collector (its flusher converting records every 0.5 s while the loop runs); its truth
is what the device ran, labelled by the loop at each launch, and the loop's own clock.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

import gputrace
from gputrace import load
from gputrace.analyzers import analyze
from gputrace.analyzers.core.frame import build
from gputrace.analyzers.core.steps import analyze_rank
from gputrace.collectors.cupti import CuptiCollector
from gputrace.recorder.core import Recorder, set_current
from gputrace.trace.schema import COLUMN_NAMES
from tests.fakes.cupti import FakeCupti, FakeDevice, pthread_id

MS = 1_000_000


class Tagged(FakeDevice):
    """The device, with the loop's iteration index kept beside each record it ran."""

    def __init__(self, cu: FakeCupti) -> None:
        super().__init__(cu)
        self.tag = -1
        self.tags: list[int] = []

    def _enqueue(self, label, dur_ns, stream, after=0):  # type: ignore[no-untyped-def]
        out = super()._enqueue(label, dur_ns, stream, after)
        self.tags.append(self.tag)
        return out


class Worker(threading.Thread):
    """A thread that launches work for the loop while the loop waits (as autograd's device
    thread launches the backward, or a comm thread NCCL's all-reduces)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: queue.Queue = queue.Queue()
        self.start()

    def run(self) -> None:
        while True:
            fn, done = self.jobs.get()
            fn()
            done.set()

    def call(self, fn) -> threading.Event:  # type: ignore[no-untyped-def]
        done = threading.Event()
        self.jobs.put((fn, done))
        return done


def training_loop(dev: Tagged, iters: int, pinned: bool, sync_every: int
                  ) -> tuple[list[int], dict[str, np.ndarray]]:
    """A data-parallel-like loop: the batch copied to the device outside any phase, forward
    launched by the loop thread, backward by another thread while the loop waits in its
    backward phase, one NCCL all-reduce per two layers launched by a comm thread as their
    gradients are done, the update after the last. Returns the loop's own boundaries and
    its truth: CUDA events recorded as the host enters and leaves each phase."""
    autograd, comm = Worker("autograd-device"), Worker("comm")
    bounds = [time.time_ns()]
    ev = {k: np.zeros(iters) for k in ("h2d", "forward", "backward", "update")}
    # each iteration's event windows (the copy's, each phase's): where the device was busy
    # for it or the phase held it, as CUDA events around them mark it
    ev["windows"] = [[] for _ in range(iters)]  # type: ignore[assignment]
    for k in range(iters):
        dev.tag = k
        with gputrace.phase("io"):
            time.sleep(0.0003)
        copy: list[tuple[int, int]] = []
        dev.h2d(8 << 20, pinned=pinned, label="h2d", events=copy)
        ev["h2d"][k] = (copy[0][1] - copy[0][0]) / 1e9
        ev["windows"][k].append(copy[0])
        with gputrace.phase("forward"):
            e0 = dev.event()
            for i in range(6):
                dev.kernel(f"fwd_gemm_{i}", int(0.3 * MS), "forward")
            e1 = dev.event()
            ev["forward"][k] = (e1 - e0) / 1e9
            ev["windows"][k].append((e0, e1))
        sent: list[threading.Event] = []

        def backward(sent: list[threading.Event] = sent) -> None:
            for i in range(6):
                end = dev.kernel(f"bwd_gemm_{i}", int(0.6 * MS), "backward")
                if i % 2 == 1:
                    sent.append(comm.call(lambda end=end: dev.kernel(
                        "ncclDevKernel_AllReduce_Sum_f32_RING_LL", int(0.5 * MS), "comm",
                        stream=13, after=end)))

        with gputrace.phase("backward"):
            e0 = dev.event()
            autograd.call(backward).wait()
            for s in sent:
                s.wait()
            e1 = dev.event()
            ev["backward"][k] = (e1 - e0) / 1e9
            ev["windows"][k].append((e0, e1))
        with gputrace.phase("update"):
            dev.wait_for(13)          # the update waits for the all-reduces on the device
            e0 = dev.event()
            for _ in range(3):
                dev.kernel("sgd_update", int(0.1 * MS), "update")
            e1 = dev.event()
            ev["update"][k] = (e1 - e0) / 1e9
            ev["windows"][k].append((e0, e1))
        if (k + 1) % sync_every == 0:
            dev.synchronize()
        gputrace.step()
        bounds.append(time.time_ns())
    dev.synchronize()
    return bounds, ev


def _union_len(iv: list[tuple[int, int]]) -> int:
    tot, end = 0, None
    for s, e in sorted(iv):
        if end is None or s > end:
            tot += e - s
            end = e
        elif e > end:
            tot += e - end
            end = e
    return tot


def _intersect_len(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    return _union_len(a) + _union_len(b) - _union_len(a + b)


SLACK_S = 1e-4


def _close(got: np.ndarray, want: np.ndarray, rel: float = 0.05) -> bool:
    """Per iteration within 5 % of the CUDA-event truth, for the median iteration. The
    events of a loop played out on a shared CPU carry the host's scheduling (an event
    recorded on an idle device completes at the host's time): 0.1 ms of slack for that."""
    return float(np.median(np.abs(got - want) - rel * want)) <= SLACK_S


def comm_truth(dev: Tagged, iters: int) -> dict[str, np.ndarray]:
    """Per iteration (of launch): comm on the device, total and hidden under everything
    else the device ran."""
    ran = list(zip(dev.tags, dev.ran, strict=True))
    cover = [(s, e) for _, (lb, s, e) in ran if lb != "comm"]
    out = {k: np.zeros(iters) for k in ("comm", "hidden")}
    for k in range(iters):
        cm = [(s, e) for t, (lb, s, e) in ran if t == k and lb == "comm"]
        out["comm"][k] = _union_len(cm) / 1e9
        out["hidden"][k] = _intersect_len(cm, cover) / 1e9
    return out


def record_loop(tmp_path, iters: int, pinned: bool, sync_every: int):  # type: ignore[no-untyped-def]
    cu = FakeCupti(clock_offset_ns=0)
    dev = Tagged(cu)
    rec = Recorder(str(tmp_path / "gpu.arrow"), {"host": "h", "rank": 0})
    col = CuptiCollector(rec, cupti=cu)
    col.start()
    rec.start()          # the flusher converts CUPTI's buffers while the loop runs
    set_current(rec)
    try:
        bounds, events = training_loop(dev, iters, pinned, sync_every)
    finally:
        set_current(None)
        rec.close()
    return load(tmp_path / "gpu.arrow"), dev, bounds, events, rec


@pytest.mark.parametrize("pinned,sync_every", [(True, 5), (False, 1)])
def test_gpu_records_take_the_phase_and_iteration_of_their_launch(tmp_path, pinned, sync_every):
    iters = 30
    tr, dev, bounds, events, rec = record_loop(tmp_path, iters, pinned, sync_every)
    rows = tr.table.to_pylist()

    # the records are as a real GPU gives them: threads named unlike their native TIDs,
    # correlation ids interleaved across threads, work run after the host moved on
    assert set(rec.threads) and all(pt != tid for tid, pt in rec.threads.items())
    cu_threads = dev.cu.threads_seen                     # loop, autograd and comm threads
    assert len(cu_threads) == 3 and not cu_threads & set(rec.threads)
    gpu = [r for r in rows if r["cat"] in ("kernel", "memcpy", "comm")]
    assert len(gpu) == len(dev.ran)
    its = sorted((r for r in rows if r["cat"] == "iteration"), key=lambda r: r["start_ns"])
    assert [r["step"] for r in its] == list(range(iters))
    late = [r for r in gpu if r["start_ns"] >= its[min(r["step"] + 1, iters - 1)]["start_ns"]
            and r["step"] + 1 < iters]
    if pinned:   # the host runs ahead: many records run in a later host iteration
        assert len(late) > len(gpu) // 4, len(late)

    # every record has the phase it was launched in, and the step of its launch
    labels = {(s, e): (lb, t) for t, (lb, s, e) in zip(dev.tags, dev.ran, strict=True)}
    for r in gpu:
        lb, t = labels[(r["start_ns"], r["end_ns"])]
        assert r["phase"] == lb, (r["name"], r["phase"], lb)
        assert r["step"] == t and r["launch_ns"] is not None
        assert its[t]["start_ns"] <= r["launch_ns"] <= its[t]["end_ns"]

    # the breakdown is the device's time per phase, per launching iteration, as CUDA
    # events around each phase measure it
    a = analyze(tr)
    ra = a.main
    truth = comm_truth(dev, iters)
    sel = slice(ra.warmup_skipped, iters)
    b = ra.breakdown
    (sp,) = build(tr.table).ranks.values()
    per_it = analyze_rank(sp).terms
    for term, ph in (("t_h2d", "h2d"), ("t_f", "forward"), ("t_b", "backward"),
                     ("t_u", "update")):
        # iteration by iteration: a preemption of the host between a copy's end and the
        # event after it (this machine is shared) moves one iteration's truth, not all
        assert _close(per_it[term][sel], events[ph][sel]), (term, per_it[term][sel],
                                                            events[ph][sel])
        want = float(np.mean(events[ph][sel]))
        assert b[term].mean == pytest.approx(want, rel=0.15), (term, b[term].mean, want)
    assert b["t_comm"].mean == pytest.approx(float(np.mean(truth["comm"][sel])), rel=0.02)
    want_hidden = float(np.mean(truth["hidden"][sel]))
    assert ra.comm["hidden_s"] == pytest.approx(want_hidden, rel=0.05, abs=2e-5)
    assert ra.comm["exposed_s"] == pytest.approx(float(np.mean(truth["comm"][sel]))
                                                 - want_hidden, rel=0.05, abs=2e-5)
    own = np.diff(bounds)[sel] / 1e9
    assert b["t_iter"].mean == pytest.approx(float(np.mean(own)), rel=0.02)
    # every phase the loop has is found: what is left over is the iteration's own time
    # beyond its wait for data, everything the device ran for it and its phases' event
    # windows (a phase the host held longer than the device ran is the phase's, as CUDA
    # events measure it: on a slow host, not time in no phase)
    busy = np.array([_union_len([(s, e) for t, (_, s, e) in zip(dev.tags, dev.ran, strict=True)
                                 if t == k] + events["windows"][k])
                     for k in range(iters)]) / 1e9
    want_other = float(np.mean(own - busy[sel])) - b["t_io"].mean
    assert b["t_other"].mean == pytest.approx(want_other, abs=0.05 * float(np.mean(own))), \
        (b["t_other"].mean, want_other)


def test_a_dump_of_the_collectors_input_replays_to_what_it_wrote(tmp_path, monkeypatch):
    """GPUTRACE_CUPTI_DUMP keeps what the collector received (spans, records, the thread
    map); replayed through the conversion it gives the rows the live recording wrote: the
    way real GPU records become CPU test fixtures."""
    from tests.truth import replay_cupti_dump

    dump = tmp_path / "dump.jsonl.gz"
    monkeypatch.setenv("GPUTRACE_CUPTI_DUMP", str(dump))
    tr, dev, *_ = record_loop(tmp_path, 12, True, 4)

    def key(r):  # type: ignore[no-untyped-def]
        return (r[1], r[2], r[3], r[4], r[20], r[21])

    live = sorted(key(tuple(r[c] for c in COLUMN_NAMES)) for r in tr.table.to_pylist()
                  if r["cat"] in ("kernel", "memcpy", "comm"))
    again = sorted(key(r) for r in replay_cupti_dump(dump) if r[1] in ("kernel", "memcpy",
                                                                         "comm"))
    assert len(live) == len(dev.ran) and live == again


def test_launches_join_their_own_threads_ranges_through_the_pthread_id():
    """A prefetching thread copies the next batch in its own `h2d` range while the loop
    runs its forward. CUPTI names both threads by pthread id: joined to their native TIDs
    through the recorder's thread map, the copy is h2d and the loop's kernel forward;
    without the map both would fall to the loop's range."""
    from gputrace.collectors.cupti_convert import Converter
    from tests.fakes.cupti import ActivityMemcpyKind, ActivityMemoryKind

    cu = FakeCupti()
    rec = Recorder("/nonexistent/unused.arrow", {"host": "h"})
    t0 = rec.now_ns()
    rec.span("forward", "forward", t0, t0 + 10 * MS)
    c_loop = cu.launch(None, t0 + 5 * MS)

    def prefetch() -> None:
        rec.span("h2d", "prefetch", t0 + 2 * MS, t0 + 4 * MS)
        c = cu.launch(None, t0 + 3 * MS)
        cu.memcpy(c, t0 + 20 * MS, t0 + 21 * MS, 1 << 20, ActivityMemcpyKind.HTOD,
                  ActivityMemoryKind.PINNED, ActivityMemoryKind.DEVICE, stream=9)

    th = threading.Thread(target=prefetch)
    th.start()
    th.join()
    cu.kernel(c_loop, "gemm", t0 + 30 * MS, t0 + 31 * MS)     # runs after both ranges closed
    spans = list(rec._spans)
    assert len(rec.threads) == 2 and not set(rec.threads.values()) & set(rec.threads)
    assert pthread_id() == rec.threads[threading.get_native_id()]

    def phases(conv: Converter) -> dict[str, tuple[str | None, int]]:
        conv.add_spans(spans)
        conv.feed(list(cu.queued))
        return {r[1]: (r[20], r[21]) for r in conv.drain(final=True) if r[1] != "user"}

    got = phases(Converter(cu, host="h", rank=0, pid=1, threads=rec.threads))
    assert got == {"kernel": ("forward", t0 + 5 * MS), "memcpy": ("h2d", t0 + 3 * MS)}
    blind = phases(Converter(cu, host="h", rank=0, pid=1))
    assert blind["memcpy"][0] == "forward"


@pytest.mark.slow
@pytest.mark.parametrize("args", [[], ["--accumulate", "2", "--loader"]])
def test_torch_auto_instrumentation_on_a_device_that_runs_behind(tmp_path, args):
    """PyTorch's hooks give the phases, CUPTI-shaped records the device time: forward
    kernels launched in modules, the loss outside them, backward in autograd functions,
    the update in the optimizer's step, the batch's copy before the forward."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    job = Path(__file__).resolve().parent / "jobs" / "fake_gpu_torch.py"
    out, tp = tmp_path / "t.arrow", tmp_path / "truth.json"
    steps = 16
    p = subprocess.run([sys.executable, str(job), str(out), str(tp), "--steps", str(steps),
                        *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(tp.read_text())
    truth, events = got["ran"], got["events"]
    rows = load(out).table.to_pylist()
    its = [r for r in rows if r["cat"] == "iteration"]
    assert len(its) == steps and {r["name"] for r in its} == {"iteration"}
    gpu = {(r["start_ns"], r["end_ns"]): r for r in rows
           if r["cat"] in ("kernel", "memcpy", "memset")}
    assert len(gpu) == len(truth)
    for _t, lb, s, e in truth:
        assert gpu[(s, e)]["phase"] == lb, (gpu[(s, e)]["name"], gpu[(s, e)]["phase"], lb)
    tr = load(out)
    ra = analyze(tr).main
    (sp,) = build(tr.table).ranks.values()
    per_it = analyze_rank(sp).terms
    sel = slice(ra.warmup_skipped, steps)
    for term, ph in (("t_h2d", "h2d"), ("t_f", "forward"), ("t_b", "backward"),
                     ("t_u", "update")):
        want = np.array([e[ph] for e in events])[sel] / 1e9
        assert _close(per_it[term][sel], want), (term, per_it[term][sel], want)
    # time in no phase is the loop's own: its iteration less its phases' events and waits
    # for data (zero_grad, the loop's Python between phases)
    ends = np.array([e["end"] for e in events])
    own = (np.diff(ends) / 1e9 - np.array([
        sum(e[k] for k in ("h2d", "forward", "backward", "update")) / 1e9 + e["io"] / 1e9
        for e in events[1:]]))
    k = sel.start
    got_other = float(np.median(per_it["t_other"][k:]))
    assert abs(got_other - float(np.median(own[k - 1:]))) < 0.1 * float(
        np.median(per_it["t_iter"][k:])), (per_it["t_other"][k:], own[k - 1:])


@pytest.mark.slow
def test_cupti_records_only_inside_a_window(tmp_path):
    """A Session with a window of steps 5-7: CUPTI's activity kinds are enabled for the
    window's iterations and disabled for every other (so outside it the job pays nothing
    for GPU records); every iteration is kept, GPU records only the window's, each where the
    device ran it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    job = Path(__file__).resolve().parent / "jobs" / "fake_gpu_torch.py"
    out, tp = tmp_path / "t.arrow", tmp_path / "truth.json"
    steps, lo, n = 12, 5, 3
    p = subprocess.run([sys.executable, str(job), str(out), str(tp), "--steps", str(steps),
                        "--window", f"{lo}:{n}"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(tp.read_text())
    on = [k for k, e in enumerate(got["events"]) if e["kinds"] > 0]
    assert on == list(range(lo, lo + n)), [e["kinds"] for e in got["events"]]
    tr = load(out)
    rows = tr.table.to_pylist()
    assert tr.metadata["window"]["steps"] == [lo, n]
    its = {r["step"] for r in rows if r["cat"] == "iteration"}
    assert its == set(range(lo, lo + n))     # the window's, with full detail
    gpu = {(r["start_ns"], r["end_ns"]): r for r in rows
           if r["cat"] in ("kernel", "memcpy", "memset")}
    inside = [(s, e, lb) for _t, lb, s, e in got["ran"]
              if lo <= _t < lo + n]
    assert gpu and all((s, e) in gpu and gpu[(s, e)]["phase"] == lb for s, e, lb in inside)
    summary = [json.loads(r["args"]) for r in rows if r["name"] == "cupti.summary"]
    assert summary and summary[0]["window_switches"] >= 2, summary
