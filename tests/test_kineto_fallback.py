"""The torch.profiler (Kineto) fallback for GPU timelines when CUPTI cannot be used directly.

On this machine torch has no CUDA, so the conversion is checked on a real Kineto trace of a
GPU job (../shared/data), and the session's life in a recorded job (start at torch import,
stop at exit or when the job starts its own profiler, export, import) with Kineto's CPU
activity, whose operator events the fallback leaves out.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from gputrace.trace import load
from tests.conftest import run_gputrace, write_h2d_job

torch = pytest.importorskip("torch")

WINDOW = 2_000_000   # ns


def test_kineto_records_become_rows_attributed_to_gputrace_phases(shared_data, tmp_path):
    from torch.profiler import ProfilerActivity

    from gputrace.collectors.kineto import KinetoCollector
    from gputrace.metadata import base_metadata
    from gputrace.recorder.core import Recorder
    from gputrace.trace.schema import COLUMN_NAMES

    src = shared_data / "kineto/nccl_data.json.gz"
    d = json.load(gzip.open(src))
    base = d.get("baseTimeNanoseconds", 0)
    ev = [e for e in d["traceEvents"] if e.get("ph") == "X"]

    def ns(e):
        return round(e["ts"] * 1000) + base

    runtime = {e["args"]["correlation"]: e for e in ev if e.get("cat") == "cuda_runtime"
               and "correlation" in e.get("args", {})}
    lo = min(ns(e) for e in runtime.values())
    hi = max(ns(e) for e in runtime.values())
    # gputrace phases on every launching thread: forward and backward windows in turn
    phases = []
    for key in {(e["pid"], e["tid"]) for e in runtime.values()}:
        for k, t in enumerate(range(lo, hi + 1, WINDOW)):
            phases.append((key, t, t + WINDOW - 1, ("forward", "backward")[k % 2]))
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    expected = {}
    for e in gpu:
        launch = runtime.get(e["args"].get("correlation"))
        if e["cat"] == "kernel" and e["name"].lower().startswith("nccl"):
            ph = "comm"
        elif launch is None:
            ph = None
        else:
            ph = ("forward", "backward")[(ns(launch) - lo) // WINDOW % 2]
        expected[(ns(e), e["name"])] = ph

    rec = Recorder(str(tmp_path / "unused.arrow"), base_metadata("process"))
    col = KinetoCollector(rec, torch, [ProfilerActivity.CPU])
    rows = [dict(zip(COLUMN_NAMES, r, strict=True)) for r in
            col.convert(str(src), phases, [(lo, hi, 7)])]
    by_cat = {c: sum(r["cat"] == c for r in rows) for c in {r["cat"] for r in rows}}
    kernels = sum(e["cat"] == "kernel" for e in gpu)
    assert by_cat["kernel"] + by_cat["comm"] == kernels
    assert by_cat["memcpy"] == sum(e["cat"] == "gpu_memcpy" for e in gpu)
    assert by_cat["memset"] == sum(e["cat"] == "gpu_memset" for e in gpu)
    assert set(by_cat) <= {"kernel", "comm", "memcpy", "memset", "sync"}   # no CPU ops
    got = {(r["start_ns"], r["name"]): r["phase"] for r in rows if r["cat"] != "sync"}
    assert got == expected
    assert sum(v in ("forward", "backward") for v in got.values()) > kernels // 2
    assert {r["host"] for r in rows} == {rec.host} and {r["pid"] for r in rows} == {rec.pid}
    launched = [r for r in rows if r["cat"] != "sync" and r["phase"] not in (None, "comm")]
    assert {r["step"] for r in launched} == {7}
    assert col.counts["events_read"] == len(d["traceEvents"])


SCRIPT = """
    import sys
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(n):
        for _ in range(n):
            loss = model(torch.randn(32, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    train(5)
    if len(sys.argv) > 1:   # the job's own profiler, after gputrace's session started
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as p:
            train(3)
        p.export_chrome_trace(sys.argv[1])
    print("trained")
"""


@pytest.mark.parametrize("own_profiler", [False, True])
def test_fallback_session_in_a_recorded_job(tmp_path, own_profiler):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out, own = tmp_path / "t.arrow", tmp_path / "own.json"
    env = dict(os.environ, GPUTRACE_KINETO_CPU="1")
    p = run_gputrace("record", "-q", "--gpu-timeline", "kineto", "-o", str(out), "--",
                     sys.executable, str(script), *([str(own)] if own_profiler else []),
                     env=env)
    assert p.returncode == 0, p.stderr
    assert "trained" in p.stdout
    tr = load(out)
    status = tr.metadata["collectors"]["cupti"]["status"]
    assert status.startswith("ok: torch.profiler (Kineto) fallback"), status
    rows = tr.table.to_pylist()
    summary = [r for r in rows if r["name"] == "cupti.summary"]
    assert len(summary) == 1
    args = json.loads(summary[0]["args"])
    assert args["source"] == "torch.profiler" and "error" not in args, args
    assert args["records"]["events_read"] > 0           # the session's export was read
    assert not [r for r in rows if r["cat"] in ("kernel", "memcpy")]   # CPU ops left out
    assert sum(r["cat"] == "iteration" for r in rows) == (8 if own_profiler else 5)
    if own_profiler:
        assert "starts its own torch.profiler" in p.stderr
        ops = [e for e in json.loads(own.read_text())["traceEvents"]
               if e.get("cat") == "cpu_op" and e.get("name") == "aten::linear"]
        assert len(ops) == 3 * 2                      # the job's own profile is whole
    else:
        assert "own torch.profiler" not in p.stderr


WINDOWED = """
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(8):
        with torch.autograd.profiler.record_function(f"job_step_{i}"):   # the job's own mark
            loss = model(torch.randn(32, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
"""


def test_fallback_collects_only_inside_a_window(tmp_path):
    """`--steps 3:2`: the session's collection is on for iterations 3 and 4 only (the job
    marks each of its iterations; Kineto's own export, kept, holds the marks it collected)."""
    script, out, kept = tmp_path / "job.py", tmp_path / "t.arrow", tmp_path / "kineto.json"
    script.write_text(textwrap.dedent(WINDOWED))
    env = dict(os.environ, GPUTRACE_KINETO_CPU="1", GPUTRACE_KINETO_KEEP=str(kept))
    p = run_gputrace("record", "-q", "--gpu-timeline", "kineto", "--steps", "3:2", "-o",
                     str(out), "--", sys.executable, str(script), env=env)
    assert p.returncode == 0, p.stderr
    doc = json.loads(kept.read_text())
    events, base_ns = doc["traceEvents"], int(doc.get("baseTimeNanoseconds", 0))
    marks = sorted(e["name"] for e in events if e.get("name", "").startswith("job_step_"))
    assert marks == ["job_step_3", "job_step_4"], marks
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    context = json.loads(Path(f"{kept}.context.json").read_text())
    inside = [(s, e) for s, e, step in context["iters"] if step in (3, 4)]
    assert ops and len(inside) == 2
    # every operator Kineto collected ran inside the window's iterations
    for op in ops:
        t = base_ns + float(op["ts"]) * 1000
        assert any(s <= t <= e for s, e in inside), (op["name"], t, inside)
    rows = load(out).table.to_pylist()
    (summary,) = [json.loads(r["args"]) for r in rows if r["name"] == "cupti.summary"]
    assert summary["window_switches"] == 3, summary     # off before step 0, on at 3, off at 5


def test_bad_gpu_timeline_is_one_line(tmp_path):
    p = run_gputrace("record", "--gpu-timeline", "nsys", "--", sys.executable, "-c", "1")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "Traceback" not in p.stderr


def test_harness_session_starts_the_fallback_through_instrument(tmp_path):
    """`gputrace.torch.instrument(gpu_timeline=...)` inside a Session, as a harness does."""
    job = tmp_path / "harness.py"
    out = tmp_path / "s.arrow"
    job.write_text(textwrap.dedent(f"""
        import torch
        import gputrace
        import gputrace.torch as gt
        model = torch.nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gputrace.Session({str(out)!r}, sampler=False) as s:
            print(gt.instrument(model, opt, gpu_timeline="kineto"))
            for _ in range(4):
                loss = model(torch.randn(8, 16)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
    """))
    import subprocess
    p = subprocess.run([sys.executable, str(job)], capture_output=True, text=True,
                       env=dict(os.environ, GPUTRACE_KINETO_CPU="1"), timeout=120)
    assert p.returncode == 0, p.stderr
    tr = load(out)
    assert tr.metadata["collectors"]["cupti"]["status"].startswith("ok: torch.profiler")
    rows = tr.table.to_pylist()
    summary = [json.loads(r["args"]) for r in rows if r["name"] == "cupti.summary"]
    assert len(summary) == 1 and summary[0]["records"]["events_read"] > 0
    assert sum(r["cat"] == "iteration" for r in rows) == 4


@pytest.mark.gpu
def test_gpu_kernels_and_copies_from_the_fallback(tmp_path):
    """On a GPU: kernels and pinned/pageable H2D copies through Kineto, attributed to phases."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    script = write_h2d_job(tmp_path / "h2d_job.py", 64)
    out = tmp_path / "k.arrow"
    p = run_gputrace("record", "--gpu-timeline", "kineto", "-o", str(out), "--",
                     sys.executable, str(script), timeout=300)
    assert p.returncode == 0, p.stderr
    tr = load(out)
    assert tr.metadata["collectors"]["cupti"]["status"].startswith("ok: torch.profiler")
    rows = tr.table.to_pylist()
    cp = [r for r in rows if r["cat"] == "memcpy" and r["dst_kind"] == "device"
          and (r["bytes"] or 0) >= 64 << 20]
    assert {r["src_kind"] for r in cp} == {"pinned", "pageable"}
    assert all(r["phase"] == "h2d" for r in cp)
    assert any(r["cat"] == "kernel" and r["phase"] == "forward" for r in rows)


def test_fallback_joins_kinetos_pthread_ids_to_the_native_tids_of_phases(shared_data,
                                                                         tmp_path):
    """With only the CUDA activity on, Kineto sees no operator on any thread and names each
    launching thread by the low 32 bits of its pthread_self, as a signed int (as it does in
    real traces for threads without operators: tid -549452224 in nccl_data). The fallback
    joins them to the native TIDs gputrace's phases carry through the recorder's map."""
    from torch.profiler import ProfilerActivity

    from gputrace.collectors.kineto import KinetoCollector
    from gputrace.metadata import base_metadata
    from gputrace.recorder.core import Recorder
    from gputrace.trace.schema import COLUMN_NAMES

    src = shared_data / "kineto/nccl_data.json.gz"
    d = json.load(gzip.open(src))
    ev = [e for e in d["traceEvents"] if e.get("ph") == "X"]
    assert any(e.get("cat") == "cuda_runtime" and e["tid"] < 0 for e in ev)
    base = d.get("baseTimeNanoseconds", 0)
    runtime = [e for e in ev if e.get("cat") == "cuda_runtime"]
    native = sorted({e["tid"] for e in runtime if e["tid"] > 0})
    # pthread ids of those threads (one above 2**31: a negative int32 in the JSON)
    pthread = {tid: [0xA246B140, 0x5C9FF640, 0x7A1FE700][i] for i, tid in enumerate(native)}

    def signed(v):
        return v - (1 << 32) if v >= 1 << 31 else v

    for e in runtime:
        if e["tid"] in pthread:
            e["tid"] = signed(pthread[e["tid"]])
    path = tmp_path / "cuda_only.json"
    path.write_text(json.dumps(d))
    lo = min(round(e["ts"] * 1000) + base for e in runtime)
    hi = max(round(e["ts"] * 1000) + base for e in runtime)
    pid = runtime[0]["pid"]
    phases = [((pid, native[0]), lo, hi, "forward"),           # the loop thread's range
              ((pid, native[1]), lo, (lo + hi) // 2, "backward")]
    rec = Recorder(str(tmp_path / "unused.arrow"), base_metadata("process"))
    rec.pid = pid
    rec.threads.update(pthread)
    col = KinetoCollector(rec, torch, [ProfilerActivity.CPU])
    col.loop_tid = native[0]
    rows = [dict(zip(COLUMN_NAMES, r, strict=True)) for r in
            col.convert(str(path), phases, [(lo, hi, 3)])]
    launched = [r for r in rows if r["cat"] in ("kernel", "memcpy", "memset")
                and r["launch_ns"] is not None]
    assert len(launched) > 100
    got = {r["phase"] for r in launched}
    assert None not in got and got >= {"forward", "backward"}
    assert len(native) > 1
    rec2 = Recorder(str(tmp_path / "u2.arrow"), base_metadata("process"))
    rec2.pid = pid
    blind = KinetoCollector(rec2, torch, [ProfilerActivity.CPU])
    blind.loop_tid = native[0]
    phases_blind = {r[20] for r in blind.convert(str(path), phases, [(lo, hi, 3)])
                    if r[1] in ("kernel", "memcpy", "memset")}
    # without the map every launch falls to the loop thread's range: the second thread's
    # own backward range is never seen
    assert "backward" not in phases_blind and "forward" in phases_blind
