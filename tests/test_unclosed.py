"""The path the user named leads to the data: after kill -9 of an embedded Session's job or
of `gputrace record` itself, `analyze|info|export run.arrow` read its shards and say once
that the run was not closed, and `gputrace recover run.arrow` writes run.arrow."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

import gputrace
from gputrace import load
from gputrace.cli import main
from gputrace.trace import shards
from tests.conftest import GPUTRACE, run_gputrace

# Records a span every 5 ms and logs each one itself (line-buffered: a kill -9 keeps it).
SESSION_JOB = textwrap.dedent("""
    import sys, time, gputrace
    log = open(sys.argv[2], "a", buffering=1)
    with gputrace.Session(sys.argv[1], flush_interval_s=0.5) as s:
        i = 0
        while True:
            t = time.time_ns()
            s.record_span("user", f"ev{i}", t, t + 1000)
            log.write(f"{i} {t}\\n")
            i += 1
            time.sleep(0.005)
""")
RECORDED_JOB = SESSION_JOB.replace("with gputrace.Session(sys.argv[1], flush_interval_s=0.5) "
                                   "as s:", "if True:").replace("s.record_span",
                                                                "gputrace.record_span")


def _wait_for_log(log: Path) -> None:
    deadline = time.time() + 60
    while not (log.exists() and log.stat().st_size > 0) and time.time() < deadline:
        time.sleep(0.01)
    assert log.exists(), "the job never started"


def _logged(log: Path) -> list[tuple[int, int]]:
    return [tuple(map(int, ln.split())) for ln in log.read_text().splitlines()
            if len(ln.split()) == 2]


def _released(path: Path) -> None:
    """Wait until no process records into the shards of `path` any more: the sampler of a
    killed Session notices its job is gone and closes its own shard."""
    deadline = time.time() + 15
    while time.time() < deadline:
        if not any(shards.in_use(d) for d in shards.find(str(path))):
            return
        time.sleep(0.05)
    raise AssertionError(f"the shards of {path} are still held 15 s after the kill")


def _check_unclosed_then_recover(out: Path, logged: list[tuple[int, int]], kill_ns: int
                                 ) -> int:
    """analyze/info/export find the shards and say so once; every event older than 1 s is
    there; recover writes `out` with the same events. Returns how many were checked."""
    assert not out.exists()
    (d,) = shards.find(str(out))
    for cmd in (["analyze"], ["info"], ["export", "--format", "chrome", "-o",
                                        str(out.with_suffix(".json"))]):
        p = run_gputrace(*cmd, str(out))
        assert p.returncode == 0, (cmd, p.stderr)
        notes = [ln for ln in p.stderr.splitlines() if "not closed" in ln]
        assert len(notes) == 1 and f"gputrace recover {out}" in notes[0], (cmd, p.stderr)
        assert "Traceback" not in p.stderr
    got = {r for r in load(out).table.column("name").to_pylist() if r.startswith("ev")}
    old = [i for i, t in logged if t < kill_ns - 1_000_000_000]
    lost = [i for i in old if f"ev{i}" not in got]
    assert not lost, f"{len(lost)} of {len(old)} events older than 1 s were lost"
    p = run_gputrace("recover", str(out))
    assert p.returncode == 0, p.stderr
    assert out.exists() and not os.path.exists(d)
    tr = load(out)
    assert not tr.warnings                       # a whole file now
    assert {r for r in tr.table.column("name").to_pylist() if r.startswith("ev")} == got
    p = run_gputrace("info", str(out))
    assert "not closed" in p.stdout and "exit code" in p.stdout, p.stdout
    return len(old)


@pytest.mark.slow
def test_kill_9_of_a_session_job_then_analyze_and_recover_its_path(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(SESSION_JOB)
    rng = random.Random(19)
    checked = 0
    for k in range(3):
        out, log = tmp_path / f"run{k}.arrow", tmp_path / f"run{k}.log"
        proc = subprocess.Popen([sys.executable, str(job), str(out), str(log)])
        _wait_for_log(log)
        time.sleep(rng.uniform(1.5, 2.5))
        kill_ns = time.time_ns()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        _released(out)
        checked += _check_unclosed_then_recover(out, _logged(log), kill_ns)
    assert checked > 100   # the check had events to check


@pytest.mark.slow
def test_kill_9_of_record_itself_then_analyze_and_recover_its_path(tmp_path):
    import psutil

    job = tmp_path / "job.py"
    job.write_text(RECORDED_JOB)
    out, log = tmp_path / "rec.arrow", tmp_path / "rec.log"
    rec = subprocess.Popen([*GPUTRACE, "record", "-o", str(out), "--", sys.executable, str(job),
                            "unused", str(log)], stderr=subprocess.PIPE)
    _wait_for_log(log)
    (child,) = psutil.Process(rec.pid).children()
    time.sleep(2.5)
    kill_ns = time.time_ns()
    rec.send_signal(signal.SIGKILL)               # the OOM killer picks record ...
    rec.wait(timeout=30)
    assert shards.in_use(shards.find(str(out))[0])   # ... the job records on
    os.kill(child.pid, signal.SIGKILL)             # ... then the scheduler ends the job
    psutil.wait_procs([child], timeout=30)
    _released(out)
    assert _check_unclosed_then_recover(out, _logged(log), kill_ns) > 50


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_a_recording_still_running_is_read_but_not_recovered(tmp_path):
    out = tmp_path / "live.arrow"
    with gputrace.Session(str(out), sampler=False, flush_interval_s=0.01) as s:
        s.record_span("user", "first", 1, 2)
        deadline = time.time() + 10
        while s.recorder.rows_written == 0 and time.time() < deadline:
            time.sleep(0.01)
        rc, stdout, err = _cli("info", "--json", str(out))
        assert rc == 0, err
        spans = [c for c in json.loads(stdout)["counts"] if c["kind"] == "span"]
        assert [(c["name"], c["count_all"]) for c in spans] == [("first", 1)], stdout
        assert err.count("still being recorded") == 1, err
        rc, _, err = _cli("recover", str(out))
        assert rc == 2 and "still being recorded into" in err, err
    assert out.exists() and not shards.find(str(out))   # closed as usual


def test_recover_says_why_when_there_is_nothing_to_recover(tmp_path):
    out = tmp_path / "none.arrow"
    rc, _, err = _cli("recover", str(out))
    assert rc == 2 and "no unfinished recording" in err
    with gputrace.Session(str(out), sampler=False):
        pass
    rc, _, err = _cli("recover", str(out))
    assert rc == 2 and "was closed" in err
    not_shards = tmp_path / "somedir"
    not_shards.mkdir()
    rc, _, err = _cli("recover", str(not_shards))
    assert rc == 2 and "not a recording's shard directory" in err


def _unclosed(tmp_path: Path, name: str) -> str:
    """A recording of `name` whose process went away without closing it (its shard written,
    the shard directory left behind)."""
    code = textwrap.dedent(f"""
        import os, gputrace
        s = gputrace.Session({str(tmp_path / name)!r}, sampler=False).__enter__()
        s.record_span("user", "kept", 1, 2)
        s.recorder.flush()
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    (d,) = shards.find(str(tmp_path / name))
    return d


def test_recover_a_shard_directory_named_directly_and_refuse_to_overwrite(tmp_path):
    d = _unclosed(tmp_path, "a.arrow")
    (tmp_path / "a.arrow").write_bytes(b"precious")
    rc, _, err = _cli("recover", d)
    assert rc == 2 and "exists" in err and "-f" in err
    assert (tmp_path / "a.arrow").read_bytes() == b"precious"
    rc, stdout, err = _cli("recover", d + "/", "-o", str(tmp_path / "b.arrow"))
    assert rc == 0, err
    assert "kept" in load(tmp_path / "b.arrow").table.column("name").to_pylist()
    assert not os.path.exists(d)


def test_a_later_unclosed_recording_beside_a_trace_is_pointed_out(tmp_path):
    with gputrace.Session(str(tmp_path / "r.arrow"), sampler=False) as s:
        s.record_span("user", "old", 1, 2)
    past = time.time() - 60
    os.utime(tmp_path / "r.arrow", (past, past))
    _unclosed(tmp_path, "r.arrow")
    rc, _, err = _cli("info", str(tmp_path / "r.arrow"))
    assert rc == 0 and err.count("later recording of") == 1, err
    rc, _, err = _cli("recover", "-f", str(tmp_path / "r.arrow"))
    assert rc == 0, err
    assert "kept" in load(tmp_path / "r.arrow").table.column("name").to_pylist()


@pytest.mark.slow
def test_kill_9_of_a_training_run_then_its_goodput_over_what_it_recorded(tmp_path):
    """A training run (tests/jobs/run_phases.py, logging each step as it goes) killed with
    record after 3 s of training, then recovered: its goodput runs from its process's start to the
    last thing it recorded, said so; its steps, start-up and goodput the job's own over
    that time (its steps from the log, within 10 % or 50 ms, goodput within 2 points)."""
    import psutil

    out, log = tmp_path / "run.arrow", tmp_path / "run.log"
    job = Path(__file__).parent / "jobs" / "run_phases.py"
    rec = subprocess.Popen([*GPUTRACE, "record", "-q", "-o", str(out), "--", sys.executable,
                            str(job), str(tmp_path / "t.json"), "--steps", "2000", "--log",
                            str(log)], stderr=subprocess.PIPE)

    def trained_s() -> float:
        """Seconds since the job's first step began, from its log."""
        steps = [ln.split() for ln in (log.read_text().splitlines() if log.exists() else [])
                 if ln.startswith("step ") and len(ln.split()) == 4]
        return (int(steps[-1][3]) - int(steps[0][2])) / 1e9 if len(steps) > 1 else 0.0

    # training for 3 s: several of the recorder's flushes (0.8 s apart) behind it
    deadline = time.time() + 120
    while time.time() < deadline and trained_s() < 3.0:
        time.sleep(0.05)
    procs = [psutil.Process(rec.pid), *psutil.Process(rec.pid).children(recursive=True)]
    kill_ns = time.time_ns()
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    rec.wait(timeout=30)
    _released(out)
    assert run_gputrace("recover", str(out)).returncode == 0
    lines = [ln.split() for ln in log.read_text().splitlines()]
    t0 = int(lines[0][1])
    own = [(int(a[1]), int(a[2]), int(a[3])) for a in lines if a[0] == "step" and len(a) == 4]
    its = sorted((r for r in load(out).table.to_pylist() if r["cat"] == "iteration"),
                 key=lambda r: r["start_ns"])
    n = len(its)
    assert n >= 1 and [r["step"] for r in its] == list(range(n))
    g = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)["goodput"]
    assert g["ends_at"] == "last_record" and g["iterations"] == n
    assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                           abs=1e-6)

    def close(got: float, want: float, what: str) -> None:
        assert abs(got - want) <= max(0.10 * want, 0.050), (what, got, want)

    close(g["training_s"], sum(e - s for _, s, e in own[:n]) / 1e9, "training")
    close(g["badput_s"]["startup"], (own[0][1] - t0) / 1e9, "start-up")
    # the end: after the last step it recorded, before the kill
    hi = t0 + int(g["wall_s"] * 1e9)
    assert own[n - 1][2] - 50_000_000 <= hi <= kill_ns + 50_000_000, (own[n - 1], hi, kill_ns)
    mine = sum(max(0, min(e, hi) - s) for _, s, e in own) / (hi - t0)
    assert abs(g["goodput"] - mine) <= 0.02, (g["goodput"], mine)
    p = run_gputrace("analyze", str(out))
    assert "the run was not closed (killed?): its end is the last thing it recorded" in p.stdout
    # the page says so too, its bands within that wall time, its bar the same shares
    from tests.test_whole_run import page_specs
    page = tmp_path / "r.html"
    run_gputrace("report", str(out), "-o", str(page), check=True)
    assert "the run was not closed (killed?): its end is the last thing it recorded" \
        in page.read_text()
    bands, bar = (c["data"]["values"][0] for c in page_specs(page)["goodput"]["vconcat"])
    assert max(bands["end"]) <= g["wall_s"] + 1e-6
    share = dict(zip(bar["what"], bar["share"], strict=True))
    assert share["training steps"] == pytest.approx(g["goodput"] * 100, abs=0.01)
