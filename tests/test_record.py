"""`gputrace record` end to end: real subprocesses, exit codes, signals, shards, merge."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow.compute as pc
import pytest

from gputrace.trace import load
from gputrace.trace.parts import metadata_of
from gputrace.trace.ranked import open_by_rank
from tests.conftest import GPUTRACE, run_gputrace


def write(tmp_path, name: str, code: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(code))
    return str(p)


def names(trace, kind=None, cat=None):
    t = trace.table
    rows = t.to_pylist()
    return [r for r in rows if (kind is None or r["kind"] == kind) and (cat is None or r["cat"] == cat)]


@pytest.mark.parametrize("code", [0, 3])
def test_exit_code_is_the_childs(tmp_path, code):
    out = tmp_path / "t.arrow"
    p = run_gputrace("record", "-o", str(out), "--", sys.executable, "-c",
                     f"import sys; sys.exit({code})")
    assert p.returncode == code, p.stderr
    assert out.exists()
    assert "next: gputrace analyze" in p.stderr


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "t.arrow"
    out.write_bytes(b"precious")
    p = run_gputrace("record", "-o", str(out), "--", "true")
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "exists" in p.stderr and "-f" in p.stderr
    assert out.read_bytes() == b"precious"
    p = run_gputrace("record", "-f", "-o", str(out), "--", "true")
    assert p.returncode == 0 and load(out).num_rows > 0


def test_missing_command_is_127_and_no_command_is_2(tmp_path):
    p = run_gputrace("record", "-o", str(tmp_path / "a.arrow"), "--", "no-such-program-xyz")
    assert p.returncode == 127 and "cannot run" in p.stderr
    p = run_gputrace("record", "-o", str(tmp_path / "b.arrow"))
    assert p.returncode == 2 and "no command" in p.stderr


def test_sigint_is_forwarded_and_exit_is_130(tmp_path):
    out = tmp_path / "t.arrow"
    job = write(tmp_path, "job.py", """
        import sys, time
        print("started", flush=True)
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            print("child got SIGINT", flush=True)
            raise
    """)
    proc = subprocess.Popen([*GPUTRACE, "record", "-o", str(out), "--", sys.executable, job],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert "child got SIGINT" in stdout
    assert proc.returncode == 130, stderr
    tr = load(out)  # the trace is still written
    assert tr.metadata["exit_code"] == 130


def test_non_python_command_gets_host_samples(tmp_path):
    out = tmp_path / "t.arrow"
    p = run_gputrace("record", "-o", str(out), "--", "sleep", "1")
    assert p.returncode == 0, p.stderr
    tr = load(out)
    samples = names(tr, kind="sample")
    by_name = {}
    for r in samples:
        by_name.setdefault(r["name"], []).append(r)
    for n in ("proc.read_bytes", "proc.read_chars", "proc.write_bytes", "cpu.percent"):
        assert n in by_name, sorted(by_name)
    # The sampler runs below the job's priority: on a busy machine it takes fewer than
    # its 50 a second (at 100 Hz, 26 beside a CPU hog per core). What holds: one sample per tick it made,
    # from (within tens of ms of) the job's start to its end: 0.94-1.0 s of a `sleep 1` alone
    # and beside the hogs; 0.64-0.72 s when the first sample waited for pyarrow's import
    times = sorted(r["start_ns"] for r in by_name["proc.read_chars"])
    assert len(times) == tr.metadata["sampler"]["ticks"] >= 5
    assert tr.metadata["sampler"]["hz"] == 50
    assert (times[-1] - times[0]) / 1e9 >= 0.85
    assert all(r["unit"] == "bytes" for r in by_name["proc.read_bytes"])
    assert any(n.startswith("net.") for n in by_name)
    assert tr.metadata["argv"] == ["sleep", "1"]


def test_two_python_children_with_ranks_merge_into_one_trace(tmp_path):
    out = tmp_path / "t.arrow"
    child = write(tmp_path, "child.py", """
        import os, time, gputrace
        for i in gputrace.iterate(range(4)):
            with gputrace.phase("forward", layer=1):
                time.sleep(0.005)
            gputrace.step()
        print("rank", os.environ["RANK"], "done")
    """)
    parent = write(tmp_path, "parent.py", f"""
        import os, subprocess, sys
        procs = [subprocess.Popen([sys.executable, {child!r}],
                                  env=dict(os.environ, RANK=str(r), WORLD_SIZE="2"))
                 for r in (0, 1)]
        sys.exit(max(p.wait() for p in procs))
    """)
    p = run_gputrace("record", "-o", str(out), "--", sys.executable, parent)
    assert p.returncode == 0, p.stderr
    tr = load(out)
    spans = names(tr, kind="span")
    assert {r["rank"] for r in spans} == {0, 1}
    for rank in (0, 1):
        its = [r for r in spans if r["rank"] == rank and r["cat"] == "iteration"]
        assert [r["step"] for r in its] == [0, 1, 2, 3]
        fwd = [r for r in spans if r["rank"] == rank and r["cat"] == "forward"]
        assert len(fwd) == 4 and all(r["layer"] == 1 for r in fwd)
    assert tr.metadata["ranks"] == [0, 1]
    # the merged file is sorted by (rank, time), one rank per record batch, and the shard
    # directory is gone
    keys = list(zip(tr.table.column("rank").to_pylist(), tr.table.column("start_ns").to_pylist(),
                    strict=True))
    assert keys == sorted(keys)
    ranked = open_by_rank(out)
    assert ranked is not None and ranked.ranks == [-1, 0, 1]
    for r in ranked.ranks:   # each rank's rows read back on their own, column by column
        cols = ranked.columns(r)
        want = [t for rk, t in keys if rk == r]
        assert cols.pop("start_ns").to_pylist() == want and ranked.rows[r] == len(want)
        assert set(cols.pop("rank").to_pylist()) == {r}
    assert [f for f in os.listdir(tmp_path) if f.endswith(".shards")] == []


def test_no_gpu_collectors_say_why_in_info(tmp_path):
    out = tmp_path / "t.arrow"
    run_gputrace("record", "-o", str(out), "--", sys.executable, "-c", "pass", check=True)
    p = run_gputrace("info", str(out), env=dict(os.environ, COLUMNS="200"), check=True)
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln.strip()}
    for name in ("nvml", "cupti", "infiniband"):
        assert "unavailable:" in lines[name], p.stdout
    assert "NVML" in lines["nvml"]
    assert "ok" in lines["host"]
    tr = load(out)
    assert tr.metadata["collectors"]["nvml"]["status"].startswith("unavailable: ")


def test_environment_is_kept_only_by_allowlist(tmp_path):
    out = tmp_path / "t.arrow"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1", MY_API_TOKEN="s3cr3t-value-123")
    p = subprocess.run([*GPUTRACE, "record", "-o", str(out), "--", sys.executable, "-c",
                        "import gputrace; gputrace.record_span('user','x',1,2)"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    raw = out.read_bytes()
    assert b"s3cr3t-value-123" not in raw
    tr = load(out)
    assert tr.metadata["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert all(sh["env"].get("CUDA_VISIBLE_DEVICES") == "0,1" for sh in tr.metadata["shards"])


def test_cold_then_warm_read_shows_disk_then_cache_bytes(tmp_path):
    size = 48 << 20
    data = tmp_path / "data.bin"
    with open(data, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    log = tmp_path / "log.txt"
    job = write(tmp_path, "job.py", f"""
        import os, time
        def read_all(p):
            with open(p, "rb") as f:
                while f.read(1 << 20):
                    pass
        fd = os.open({str(data)!r}, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        marks = []
        time.sleep(0.3); marks.append(time.time_ns())
        read_all({str(data)!r}); marks.append(time.time_ns())
        time.sleep(0.3); marks.append(time.time_ns())
        read_all({str(data)!r}); marks.append(time.time_ns())
        time.sleep(0.3)
        open({str(log)!r}, "w").write(" ".join(map(str, marks)))
    """)
    out = tmp_path / "t.arrow"
    run_gputrace("record", "-o", str(out), "--hz", "200", "--", sys.executable, job, check=True)
    c0, c1, w0, w1 = map(int, log.read_text().split())
    tr = load(out)

    def counter(name):
        t = tr.table.filter(pc.equal(tr.table.column("name").cast("string"), name))
        return list(zip(t.column("start_ns").to_pylist(), t.column("value").to_pylist(), strict=False))

    def delta(series, a, b):
        before = [v for t, v in series if t <= a]
        after = [v for t, v in series if t >= b]
        return after[0] - before[-1]

    rb, rc = counter("proc.read_bytes"), counter("proc.read_chars")
    cold_disk, cold_all = delta(rb, c0, c1), delta(rc, c0, c1)
    warm_disk, warm_all = delta(rb, w0, w1), delta(rc, w0, w1)
    assert cold_disk >= 0.9 * size, (cold_disk, cold_all)
    assert warm_all >= size and warm_disk <= 0.05 * size, (warm_disk, warm_all)
    # page cache ~= read_chars - read_bytes
    assert warm_all - warm_disk >= 0.95 * size


def test_users_own_sitecustomize_still_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "marker"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    out = tmp_path / "t.arrow"
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run([*GPUTRACE, "record", "-o", str(out), "--", sys.executable, "-c",
                        "import gputrace, sys; assert gputrace.current() is not None; "
                        "assert 'torch' not in sys.modules and 'pyarrow' not in sys.modules"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert marker.read_text() == "ran"


TOGETHER = str(os.path.join(os.path.dirname(__file__), "jobs", "together.py"))


def record_together(out, barrier, ranks, force=False, wrap=lambda rank, cmd: cmd,
                    env=None) -> list[subprocess.CompletedProcess[str]]:
    """`gputrace record -o out` once per rank, all started at once, each job waiting for the
    others (so the recordings overlap); RANK and WORLD_SIZE set by hand, no launcher."""
    procs = []
    for r in ranks:
        cmd = [*GPUTRACE, "record", "-q", *(["-f"] if force else []), "-o", str(out), "--",
               sys.executable, TOGETHER, str(barrier), str(len(ranks))]
        e = dict(env or os.environ, RANK=str(r), WORLD_SIZE=str(len(ranks)))
        procs.append(subprocess.Popen(wrap(r, cmd), env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        so, se = p.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return done


def test_two_recordings_into_one_path_at_once_keep_both_traces(tmp_path):
    import json

    run = tmp_path / "run"
    run.mkdir()
    out = run / "run.arrow"
    old = run_gputrace("record", "-q", "-o", str(out), "--", "true", check=True)
    assert old.returncode == 0
    old_start = load(out).metadata["start"]["realtime_ns"]
    # without -f, a trace from before is refused as it always was
    p = record_together(out, tmp_path / "b0", [0])[0]
    assert p.returncode == 2 and "exists" in p.stderr
    # with -f, the earlier trace is replaced, but never a file of the other recording
    ps = record_together(out, tmp_path / "b1", [0, 1], force=True)
    assert [p.returncode for p in ps] == [0, 0], [p.stderr for p in ps]
    said = [line for p in ps for line in p.stderr.splitlines() if f"{out} was" in line]
    assert len(said) == 1 and "beside it" in said[0], said   # one line, by one of them
    files = sorted(f for f in os.listdir(run) if f.endswith(".arrow"))
    assert len(files) == 2 and "run.arrow" in files, files
    other = next(f for f in files if f != "run.arrow")
    # one host: its name and the recording's pid tell the part apart
    part = other.split(".")
    assert len(part) == 4 and part[0] == "run" and part[2].isdigit() and part[3] == "arrow"
    mds = [metadata_of(str(run / f)) for f in files]
    assert sorted(m["ranks"] for m in mds) == [[0], [1]]
    assert all(m["start"]["realtime_ns"] != old_start for m in mds)
    assert said[0].split(" beside it")[0].endswith(other)
    for args in (["analyze", "--json"], ["info", "--json"]):
        got = json.loads(run_gputrace(*args, str(out), check=True).stdout)
        if args[0] == "analyze":
            assert sorted(got["ranks"]) == ["0", "1"]
            assert all(got["ranks"][r]["iterations"]["count"] >= 3 for r in "01")
        else:
            assert sorted(os.path.basename(f) for f in got["files"]) == files
    # a later recording alone replaces run.arrow with -f; the part left beside it by the
    # earlier pair is not read with it (it was not recorded at the same moment)
    p = record_together(out, tmp_path / "b2", [0], force=True)[0]
    assert p.returncode == 0 and str(out) not in p.stderr
    assert (run / other).exists()
    got = json.loads(run_gputrace("info", "--json", str(out), check=True).stdout)
    assert [os.path.basename(f) for f in got["files"]] == ["run.arrow"]
    assert not [f for f in os.listdir(run) if f.endswith((".tmp", ".shards"))]
