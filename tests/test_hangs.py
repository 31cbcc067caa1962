"""A collective that a rank has not arrived at, named from the flight records of each rank
(process group and sequence number, as PyTorch's Flight Recorder keys them): a real 2-rank
gloo job (tests/jobs/hang_train.py) whose rank 1 sleeps SLEEP_S before one all-reduce, so
rank 0 waits in it. `gputrace capture` during the sleep names rank 1 as not arrived, at the
all-reduce the job counted, with rank 0's wait so far on the job's own clock; `analyze`
afterwards names it with rank 0's whole wait within 10 % of the sleep; `recover` of the job
killed during the sleep names it as still waited for; a full recording names it too, and
rank 1's sleep as a stall of its iteration; a run without the sleep names none. Rank 1
asleep before its first collective (the barrier, before any iteration) is named too."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("torch")

from gputrace.analyzers.extras.hangs import THRESHOLD_S  # noqa: E402
from gputrace.trace import load, shards  # noqa: E402
from tests.conftest import GPUTRACE, run_gputrace  # noqa: E402

pytestmark = pytest.mark.slow

JOB = str(Path(__file__).parent / "jobs" / "hang_train.py")
SLEEP_S = 10.0
# a recording read only once the job has ended needs no time for a capture: past the
# threshold by a margin that a loaded machine's timing cannot take away
FULL_SLEEP_S = THRESHOLD_S + 2.0
HANG_AT = 5
# when, after rank 1 began to sleep, the trace is read: past the threshold, and early
# enough that a capture slow to start on a loaded machine (2-3 s) still reads it asleep
READ_AT_S = THRESHOLD_S + 1.0


def _record(d: Path, sleep: float, *more: str, hang_at: int = HANG_AT,
            **kw) -> tuple[subprocess.Popen, Path]:
    out = d / "t.arrow"
    env = {**os.environ, "GPUTRACE_RUN_DIR": str(d / "run")}   # this test's recordings only
    rec = subprocess.Popen(
        [*GPUTRACE, "record", "-q", "-o", str(out), "--collectors", "torch", *more, "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", JOB, str(d / "truth.json"), "--iterations", "10", "--hang-at", str(hang_at),
         "--sleep", str(sleep)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    return rec, out


def _asleep(d: Path, rec: subprocess.Popen, read_at_s: float = READ_AT_S) -> dict:
    """Once rank 1 sleeps: what it wrote, after waiting until `read_at_s` into its sleep."""
    deadline = time.monotonic() + 180
    while not (d / "truth.sleeping").exists():
        assert rec.poll() is None, rec.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job never reached its sleep"
        time.sleep(0.05)
    time.sleep(0.05)
    slept = json.loads((d / "truth.sleeping").read_text())
    time.sleep(max(0.0, slept["wall"] + read_at_s - time.time()))
    return slept


def _truth(d: Path) -> dict[int, dict]:
    return {r: json.loads((d / f"truth.rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    d = tmp_path_factory.mktemp("hang")
    rec, out = _record(d, SLEEP_S, "--on-demand")
    try:
        slept = _asleep(d, rec)
        asked = time.time()
        p = run_gputrace("capture", str(rec.pid), "--steps", "2", "--json",
                         env={**os.environ, "GPUTRACE_RUN_DIR": str(d / "run")}, timeout=60)
        answered = time.time()
        assert p.returncode == 0, p.stderr
        (captured,) = json.loads(p.stdout)
    finally:
        _, err = rec.communicate(timeout=180)
    assert rec.returncode == 0, err[-3000:]
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    text = run_gputrace("analyze", str(out), check=True).stdout
    return {"slept": slept, "asked": asked, "answered": answered, "captured": captured, "truth": _truth(d),
            "doc": doc, "text": text, "out": out}


def test_capture_during_the_sleep_names_rank_1_not_arrived(hung):
    t = hung["truth"]
    (h,) = hung["captured"]["hangs"]["collectives"]
    assert h["ongoing"] and h["late_ranks"] == [1] and h["unknown_ranks"] == []
    assert (h["kind"], h["seq"], h["step"]) == ("all_reduce", t[0]["seq"], t[0]["step"])
    assert h["group_ranks"] == [0, 1] and h["group_desc"] == "default_pg"
    assert h["late_last_seq"] == {"1": t[0]["seq"] - 1}     # the all-reduce before it
    wait = h["waited_s"]["0"]
    # rank 0's wait so far, as of its last record, on the job's own clock
    assert wait == pytest.approx(h["as_of_unix_s"] - t[0]["entered_wall"], abs=0.05)
    assert THRESHOLD_S <= wait <= hung["answered"] - t[0]["entered_wall"]
    # seen while rank 0 waited, at most a flush (0.8 s) before the capture was asked
    assert hung["asked"] - 1.0 < h["as_of_unix_s"] < t[0]["left_wall"]
    assert "rank 1 has not arrived at all_reduce" in h["message"]


def test_analyze_names_rank_1_and_the_whole_wait(hung):
    t, doc = hung["truth"], hung["doc"]
    (h,) = doc["hangs"]["collectives"]
    assert not h["ongoing"] and h["late_ranks"] == [1] and list(h["waited_s"]) == ["0"]
    assert (h["kind"], h["seq"], h["step"]) == ("all_reduce", t[0]["seq"], t[0]["step"])
    wait = h["waited_s"]["0"]
    assert wait == pytest.approx(t[1]["slept_s"], rel=0.10)       # the job's own sleep
    assert wait == pytest.approx(t[0]["waited_s"], abs=0.05)      # rank 0's own clock
    found = [f for f in doc["findings"] if f["id"] == "collective_hang"]
    assert [f["message"] for f in found] == [h["message"]]
    assert f"rank 1 arrived last at all_reduce seq {t[0]['seq']}" in h["message"]
    assert h["message"] in hung["text"]


def test_each_rank_counts_the_collectives_as_the_job_does(hung):
    rows = [r for r in load(hung["out"]).table.to_pylist()
            if r["cat"] == "flight" and r["name"] == "state"]
    for rank, t in hung["truth"].items():
        last = max((r for r in rows if r["rank"] == rank), key=lambda r: r["start_ns"])
        a = json.loads(last["args"])
        assert (a["seq"], a["done"], a["in_flight"]) == (t["collectives"],) * 2 + (0,)


def test_recover_of_a_job_killed_in_the_hang_names_rank_1(tmp_path):
    rec, out = _record(tmp_path, SLEEP_S + 30)
    try:
        slept = _asleep(tmp_path, rec)
    finally:
        # record, torchrun and the ranks at once (torchrun starts its ranks in sessions
        # of their own: a signal to the group would leave them running)
        procs = [psutil.Process(rec.pid), *psutil.Process(rec.pid).children(recursive=True)]
        killed = time.time()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        rec.communicate(timeout=60)
    deadline = time.time() + 30
    while any(shards.in_use(d) for d in shards.find(str(out))):
        assert time.time() < deadline, "the shards are still held after the kill"
        time.sleep(0.1)
    run_gputrace("recover", str(out), check=True)
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    (h,) = doc["hangs"]["collectives"]
    assert h["ongoing"] and h["late_ranks"] == [1]
    assert (h["kind"], h["seq"], h["step"]) == ("all_reduce", slept["seq"], HANG_AT)
    # rank 1 began to sleep as rank 0 entered; its last record is at most a flush before
    assert killed - slept["wall"] - 1.5 < h["waited_s"]["0"] < killed - slept["wall"] + 0.05


def test_a_full_recording_names_the_hang_and_rank_1s_stall(tmp_path):
    rec, out = _record(tmp_path, FULL_SLEEP_S)
    _, err = rec.communicate(timeout=180)
    assert rec.returncode == 0, err[-3000:]
    t = _truth(tmp_path)
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    (h,) = doc["hangs"]["collectives"]
    assert h["late_ranks"] == [1] and (h["seq"], h["step"]) == (t[0]["seq"], HANG_AT)
    assert h["waited_s"]["0"] == pytest.approx(t[0]["waited_s"], abs=0.05)
    # rank 1's sleep is in no phase of its iteration HANG_AT; rank 0's wait is a collective
    (stall,) = [f for f in doc["ranks"]["1"]["findings"] if f["id"] == "stall"]
    named = re.findall(r"iteration (\d+) \((\d+\.\d+) s of its", stall["message"])
    assert [int(s) for s, _ in named] == [HANG_AT]
    assert float(named[0][1]) == pytest.approx(t[1]["slept_s"], rel=0.10)
    assert not [f for f in doc["ranks"]["0"]["findings"] if f["id"] == "stall"]


def test_a_rank_asleep_before_its_first_collective(tmp_path):
    """Rank 1 sleeps before the barrier, its first collective, before any iteration:
    `capture` during the sleep names it as not arrived (its state from init_process_group
    on: no collective entered yet), `analyze` afterwards as arrived last, rank 0's wait on
    its own clock; the step is none (before the first)."""
    env = {**os.environ, "GPUTRACE_RUN_DIR": str(tmp_path / "run")}
    # read 2 s later than the others, the sleep 4 s longer: the ranks leave their start-up
    # apart (no collective yet to line them up), rank 0 perhaps later than rank 1
    rec, out = _record(tmp_path, SLEEP_S + 4, "--on-demand", hang_at=-1)
    try:
        _asleep(tmp_path, rec, READ_AT_S + 2)
        p = run_gputrace("capture", str(rec.pid), "--steps", "2", "--json", env=env,
                         timeout=60)
        assert p.returncode == 0, p.stderr
        (captured,) = json.loads(p.stdout)
    finally:
        _, err = rec.communicate(timeout=180)
    assert rec.returncode == 0, err[-3000:]
    t = _truth(tmp_path)
    assert (t[0]["collective"], t[0]["seq"]) == ("barrier", 1)
    (h,) = captured["hangs"]["collectives"]
    assert h["ongoing"] and h["late_ranks"] == [1] and h["unknown_ranks"] == []
    assert (h["kind"], h["seq"], h["step"]) == ("barrier", 1, -1)
    assert h["late_last_seq"] == {"1": 0}
    assert THRESHOLD_S <= h["waited_s"]["0"] <= t[0]["waited_s"]
    assert "rank 1 has not arrived at barrier seq 1" in h["message"]
    assert "before the first step" in h["message"]
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    (h,) = doc["hangs"]["collectives"]
    assert not h["ongoing"] and h["late_ranks"] == [1] and (h["kind"], h["seq"]) == ("barrier", 1)
    assert h["waited_s"]["0"] == pytest.approx(t[0]["waited_s"], abs=0.05)
    assert h["waited_s"]["0"] == pytest.approx(t[1]["slept_s"], rel=0.10)


def test_a_run_without_a_hang_names_none(tmp_path):
    rec, out = _record(tmp_path, 0.0)
    _, err = rec.communicate(timeout=180)
    assert rec.returncode == 0, err[-3000:]
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    t = _truth(tmp_path)
    assert max(x["longest_s"] for x in t.values()) < THRESHOLD_S   # the job's own: no hang
    assert doc["hangs"] == {"threshold_s": THRESHOLD_S, "collectives": []}
    assert not [f for r in doc["ranks"].values() for f in r["findings"]
                if f["id"] in ("collective_hang", "stall")]
