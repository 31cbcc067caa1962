"""The embedded Session API, with its sampler subprocess, in a real subprocess."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import gputrace
from gputrace.trace import load


def test_session_writes_iterations_phases_io_and_samples(tmp_path):
    out = tmp_path / "run.arrow"
    code = textwrap.dedent(f"""
        import json, time, gputrace
        own = []   # the loader's own clock: when each batch was asked for and given
        def loader():
            for i in range(6):
                t0 = time.time_ns()
                time.sleep(0.02)   # the loop waits for data
                own.append((t0, time.time_ns()))
                yield i
        with gputrace.Session({str(out)!r}, hz=200) as s:
            for batch in s.iterate(loader()):
                with s.phase("h2d"):
                    time.sleep(0.002)
                with s.phase("forward", layer=1):
                    time.sleep(0.01)
                with s.phase("backward", layer=1):
                    time.sleep(0.02)
                with s.phase("update"):
                    time.sleep(0.002)
                s.step()
        json.dump(own, open({str(tmp_path / "own.json")!r}, "w"))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    import json

    own = json.loads((tmp_path / "own.json").read_text())
    tr = load(out)
    rows = tr.table.to_pylist()
    its = [r for r in rows if r["cat"] == "iteration"]
    assert [r["step"] for r in its] == list(range(6))
    io = [r for r in rows if r["cat"] == "io"]
    assert len(io) == 6
    for it, w, (t0, t1) in zip(its, io, own, strict=True):
        # the wait for data is inside its iteration, at its start, and holds the loader's
        # own time for the batch, within 15 % of it
        assert it["start_ns"] == w["start_ns"] and w["end_ns"] <= it["end_ns"]
        assert w["start_ns"] <= t0 and t1 <= w["end_ns"]
        assert (w["end_ns"] - w["start_ns"]) <= 1.15 * (t1 - t0), (w, t0, t1)
        assert w["step"] == it["step"]
    for cat in ("h2d", "forward", "backward", "update"):
        got = [r for r in rows if r["cat"] == cat]
        assert [r["step"] for r in got] == list(range(6)), cat
    assert any(r["name"] == "proc.read_chars" for r in rows)  # from the sampler process
    assert tr.metadata["collectors"]["host"]["status"] == "ok"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".shards")]


def test_record_span_is_thread_safe(tmp_path):
    out = tmp_path / "run.arrow"
    with gputrace.Session(str(out), sampler=False, flush_interval_s=0.01) as s:
        def work(k):
            for i in range(5000):
                s.record_span("comm", f"t{k}", i, i + 1, layer=k)
        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    rows = [r for r in load(out).table.to_pylist() if r["kind"] == "span"]
    for k in range(4):
        assert sorted(r["start_ns"] for r in rows if r["layer"] == k) == list(range(5000))
