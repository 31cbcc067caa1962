"""Windows opened on demand in a running job (`record --on-demand`, then `gputrace capture`
by the recording's PID, by a rank's PID and with --all, and SIGUSR2 to `record`), on a real
2-rank gloo DDP job that times itself: each window holds its iterations in full on both
ranks from the same step, within two iterations of the one each rank was in when asked
(the job's own clock)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from gputrace.recorder.core import FLUSH_INTERVAL_S  # noqa: E402
from gputrace.trace import load  # noqa: E402
from gputrace.window import unpack  # noqa: E402
from tests.conftest import GPUTRACE, run_gputrace  # noqa: E402

pytestmark = pytest.mark.slow

JOB = str(Path(__file__).parent / "jobs" / "window_loop.py")
SIGNAL_STEPS = 5


def _wait(cond, what: str, timeout: float = 120) -> None:
    t = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    d = tmp_path_factory.mktemp("capture")
    env = {**os.environ, "GPUTRACE_RUN_DIR": str(d / "run")}   # this test's recordings only
    out, truth, stop = d / "t.arrow", d / "truth.json", d / "stop"
    rec = subprocess.Popen(
        [*GPUTRACE, "record", "-q", "-o", str(out), "--on-demand", "--layers", "leaves",
         "--collectors", "torch", "--capture-steps", str(SIGNAL_STEPS), "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", JOB, str(truth), "--iterations", "100000", "--until", str(stop)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    asks = []
    try:
        _wait(lambda: (d / "truth.ready").exists() or rec.poll() is not None, "the loop")
        assert rec.poll() is None, rec.communicate()[1][-3000:]
        time.sleep(1.0)

        def capture(*how: str) -> dict:
            p = run_gputrace("capture", *how, "--json", env=env, timeout=60)
            assert p.returncode == 0, p.stderr
            (r,) = json.loads(p.stdout)
            asks.append(r)
            time.sleep(1.0)
            return r

        first = capture(str(rec.pid), "--steps", "10")
        shard_dir = Path(json.loads(next((d / "run").glob("*.json")).read_text())["shard_dir"])
        rank1 = next(json.loads(p.read_text())["pid"] for p in shard_dir.glob("*.opened")
                     if json.loads(p.read_text())["rank"] == 1)
        capture(str(rank1), "--steps", "8")
        capture("--all", "--steps", "6")
        rec.send_signal(signal.SIGUSR2)
        time.sleep(3.0)
    finally:
        stop.touch()
        _, err = rec.communicate(timeout=180)
    assert rec.returncode == 0, err[-3000:]
    rows = load(out).table.to_pylist()
    truths = {r: json.loads((d / f"truth.rank{r}.json").read_text()) for r in (0, 1)}
    runs = {r: json.loads((d / f"truth.rank{r}.run.json").read_text()) for r in (0, 1)}
    return {"rows": rows, "truth": truths, "asks": asks, "first": first, "err": err,
            "out": out, "runs": runs}


def _instants(rows, rank):
    return sorted((r["step"], json.loads(r["args"])) for r in rows
                  if r["kind"] == "instant" and r["cat"] == "window" and r["rank"] == rank)


def test_each_capture_opens_the_same_window_on_both_ranks(captured):
    rows = captured["rows"]
    for a in captured["asks"]:
        assert a["ranks"] == [0, 1] and not a["unanswered"], a
    wins = {r: _instants(rows, r) for r in (0, 1)}
    assert [s for s, _ in wins[0]] == [s for s, _ in wins[1]]
    # three commands and the signal, in the order asked
    counts = [a["count"] for _, a in wins[0]]
    assert counts == [10, 8, 6, SIGNAL_STEPS], wins[0]
    assert [s for s, _ in wins[0]][:3] == [a["start"] for a in captured["asks"]]
    for rank in (0, 1):
        full = sorted(r["step"] for r in rows if r["rank"] == rank and r["cat"] == "iteration")
        want = sorted(s + i for s, a in wins[rank] for i in range(a["count"]))
        assert full == want, rank
        # the detail inside: every layer's backward in every captured iteration
        layers = {(r["step"], r["layer"]) for r in rows if r["rank"] == rank
                  and r["cat"] == "backward" and r["layer"] > 0}
        assert {s for s, _ in layers} == set(want)
        assert len(layers) == 24 * len(want)
        # every other iteration keeps its time, none lost
        outside = [x[0] for r in rows if r["rank"] == rank and r["cat"] == "run"
                   for x in unpack(r["start_ns"], r["end_ns"], r["step"], r["args"])]
        assert sorted(outside + full) == list(range(len(captured["truth"][rank])))


def test_window_opens_at_the_first_iteration_not_yet_written_after_the_request(captured):
    """Each process reads the request at its next flush and answers the iteration it was in
    when asked, or the first it has not written yet (a flush that ran between the request's
    time and its file being written has written a few already): the window opens after the
    request, and begins before two flush intervals have passed (on a quiet machine, within
    two iterations; beside busy neighbours three or more iterations of ~20 ms went by)."""
    for rank in (0, 1):
        walls = [r["wall"] for r in captured["truth"][rank]]
        for step, a in _instants(captured["rows"], rank):
            asked = a["asked_ns"] / 1e9
            running = max(i for i, w in enumerate(walls) if w <= asked)
            assert running < step, (rank, step, running)
            assert walls[step] - asked <= 2 * FLUSH_INTERVAL_S + 0.5, \
                (rank, step, running, walls[step] - asked)


def test_analysis_lists_the_windows(captured):
    d = json.loads(run_gputrace("analyze", str(captured["out"]), "--json", "--skip", "0",
                                check=True).stdout)
    w = d["window"]
    assert w["on_demand"] is True
    assert [c["step"] for c in w["captured"]] == [x["first_step"] for x in w["windows"]]
    assert [x["iterations"] for x in w["windows"]] == [10, 8, 6, SIGNAL_STEPS]
    assert d["run"]["iterations"] == len(captured["truth"][d["rank"]])
    # each rank's goodput counts its steps outside the windows too: the job's own
    # (its iterations' time over its process's start to main's end) within 2 points
    for rank in (0, 1):
        g = d["ranks"][str(rank)]["goodput"]
        own = captured["truth"][rank]
        assert g["iterations"] == len(own)
        assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                               abs=1e-6)
        t_own = sum(r["t_iter"] for r in own)
        assert abs(g["training_s"] - t_own) <= max(0.1 * t_own, 0.05), (g, t_own)
        run = captured["runs"][rank]
        assert abs(g["goodput"] - t_own * 1e9 / (run["end"] - run["process_start"])) <= 0.02
        assert 0 <= g["stalls_outside_window_s"] <= g["badput_s"]["stalls"]
    assert d["goodput"]["job"]["ranks"] == 2
    text = run_gputrace("analyze", str(captured["out"]), check=True).stdout
    assert f"Goodput {d['goodput']['goodput']:.0%}: training steps took" in text, text


@pytest.mark.parametrize("how", [("999999999",), ("--all",), ()])
def test_nothing_to_capture_is_one_line_and_exit_2(tmp_path, how):
    env = {**os.environ, "GPUTRACE_RUN_DIR": str(tmp_path / "run")}
    p = run_gputrace("capture", *how, env=env)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_full_recording_has_no_window_to_open(tmp_path):
    env = {**os.environ, "GPUTRACE_RUN_DIR": str(tmp_path / "run")}
    rec = subprocess.Popen([*GPUTRACE, "record", "-q", "-o", str(tmp_path / "t.arrow"), "--",
                            sys.executable, "-c", "import time; time.sleep(60)"],
                           env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: any((tmp_path / "run").glob("*.json")), "the recording's listing", 60)
        for how in ((str(rec.pid),), ("--all",)):
            p = run_gputrace("capture", *how, env=env)
            assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "in full already" in run_gputrace("capture", str(rec.pid), env=env).stderr
    finally:
        rec.send_signal(signal.SIGINT)
        rec.communicate(timeout=60)
    assert not any((tmp_path / "run").glob("*.json"))   # unlisted when it ends


def test_a_window_no_process_confirms_is_one_line_and_exit_2(tmp_path):
    """The job's process answers where it stands, then stops (SIGSTOP: a process ending,
    or too busy to flush) before it says it opened the window: capture says no window is
    known to be open, in one line, exit 2 (it printed a window 'on 0 processes', exit 0)."""
    import threading

    env = {**os.environ, "GPUTRACE_RUN_DIR": str(tmp_path / "run")}
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    code = ("import os, time, torch\n"
            "m = torch.nn.Linear(8, 8); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            f"open({str(ready)!r}, 'w').close()\n"
            f"while not os.path.exists({str(stop)!r}):\n"
            "    m(torch.randn(4, 8)).sum().backward(); o.step(); o.zero_grad()\n"
            "    time.sleep(0.01)\n")
    rec = subprocess.Popen([*GPUTRACE, "record", "-q", "-o", str(tmp_path / "t.arrow"),
                            "--on-demand", "--", sys.executable, "-c", code],
                           env=env, stderr=subprocess.PIPE, text=True)
    stopped: list[int] = []
    try:
        _wait(lambda: ready.exists() and any((tmp_path / "run").glob("*.json")), "the loop", 60)
        shard_dir = Path(json.loads(next((tmp_path / "run").glob("*.json")).read_text())
                         ["shard_dir"])

        def stop_on_answer() -> None:
            t = time.monotonic() + 30
            while time.monotonic() < t and not stopped:
                for f in shard_dir.glob("capture-*-*.json"):
                    pid = json.loads(f.read_text())["pid"]
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                    return
                time.sleep(0.002)

        th = threading.Thread(target=stop_on_answer)
        th.start()
        p = run_gputrace("capture", str(rec.pid), "--steps", "3", env=env, timeout=60)
        th.join()
        assert stopped, "the job never answered"
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "none confirmed the window" in p.stderr and "no window is known to be open" \
            in p.stderr, p.stderr
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stop.touch()
        rec.communicate(timeout=60)
    assert rec.returncode == 0
