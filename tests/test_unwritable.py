"""A profiler never takes down the job it watches: an output that cannot be written, a
filesystem that fills up mid-run, a failure inside gputrace in the job: one line on stderr
saying what was lost and why; the job runs to completion and keeps its exit code."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gputrace.trace import shards
from tests.conftest import GPUTRACE, run_gputrace


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=300)


def _said(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.startswith("gputrace")]


def test_session_with_an_unwritable_output_runs_the_training_untraced(tmp_path):
    p = _run("""
        import time, gputrace
        with gputrace.Session("/proc/run.arrow") as s:
            n = 0
            for batch in s.iterate(range(5)):
                with s.phase("forward"):
                    n += batch
                s.record_span("user", "x", s.now_ns(), s.now_ns())
                s.step()
        print("trained", n)
        raise SystemExit(4)
    """)
    assert p.returncode == 4 and p.stdout == "trained 10\n", p.stderr
    (line,) = _said(p.stderr)
    assert "cannot record /proc/run.arrow" in line and "untraced" in line


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs that fills up mid-run (needs root, or skips)."""
    d = tmp_path / "tiny"
    d.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


# Records 400,000 spans with long names (~10 MB of trace) and says when it is done.
FILLER = """
import sys, time, gputrace
def work():
    for i in range(400_000):
        t = time.time_ns()
        gputrace.record_span("user", f"event-with-a-long-name-{i}", t, t + 1)
        if i % 40_000 == 0:
            time.sleep(0.6)
if sys.argv[1] == "session":
    with gputrace.Session(sys.argv[2]):
        work()
else:
    work()
print("job done", flush=True)
raise SystemExit(5)
"""


@pytest.mark.slow
def test_session_on_a_filesystem_that_fills_up_says_it_once(tiny_fs):
    out = tiny_fs / "run.arrow"
    p = _run(FILLER, "session", str(out))
    assert p.returncode == 5 and p.stdout == "job done\n", p.stderr
    (line,) = _said(p.stderr)
    assert f"could not write {out}" in line and "No space left on device" in line, line
    assert f"gputrace recover {out}" in line
    # what was written before the disk filled is there, under the name the user gave
    info = run_gputrace("info", "--json", str(out))
    assert info.returncode == 0 and '"rows": ' in info.stdout, info.stderr
    assert int(info.stdout.split('"rows": ')[1].split(",")[0]) > 1000
    assert "not closed" in info.stderr


@pytest.mark.slow
def test_record_on_a_filesystem_that_fills_up_keeps_the_exit_code(tiny_fs):
    out = tiny_fs / "rec.arrow"
    p = subprocess.run([*GPUTRACE, "record", "-o", str(out), "--", sys.executable, "-c",
                        FILLER, "record"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 5 and p.stdout == "job done\n", p.stderr
    lines = _said(p.stderr)
    # one line per process that lost data (the job's, at the moment it happened), then
    # record's own with where the rest is
    assert 1 <= len(lines) <= 2, p.stderr
    assert all("No space left on device" in ln for ln in lines), p.stderr
    assert f"gputrace recover {out}" in lines[-1]
    assert shards.find(str(out))


def test_a_span_gputrace_cannot_write_is_one_line_and_the_rest_is_kept(tmp_path):
    out = tmp_path / "t.arrow"
    p = _run("""
        import sys, time, gputrace
        with gputrace.Session(sys.argv[1], sampler=False, flush_interval_s=0.05) as s:
            s.record_span("user", "before", 1, 2)
            time.sleep(0.3)
            for _ in range(3):
                s.record_span("user", "bad", "not a time", None)   # the caller's mistake
                time.sleep(0.2)
            s.record_span("user", "after", 3, 4)
        print("done")
    """, str(out))
    assert p.returncode == 0 and p.stdout == "done\n", p.stderr
    (line,) = _said(p.stderr)
    assert "could not write" in line and "left out" in line
    from gputrace import load

    names = load(out).table.column("name").to_pylist()
    assert "before" in names and "after" in names and "bad" not in names


def test_a_collector_that_breaks_mid_run_is_one_line(tmp_path):
    out = tmp_path / "t.arrow"
    p = _run("""
        import sys, gputrace
        from gputrace.collectors import Sampler

        class Broken:
            name = "broken"
            def settings(self): return {}
            def sample(self, t): raise RuntimeError("sensor went away")
            def close(self): pass

        with gputrace.Session(sys.argv[1], sampler=False) as s:
            sm = Sampler([Broken()], s.recorder, 100, s.now_ns)
            sm.start()
            sm.stop()
            s.record_span("user", "still", 1, 2)
        print("done")
    """, str(out))
    assert p.returncode == 0 and p.stdout == "done\n", p.stderr
    (line,) = _said(p.stderr)
    assert "broken" in line and "sensor went away" in line


# torch.func.functional_call (MAML-style fast weights) puts non-leaf tensors where a module's
# parameters were: the first forward meets them, and gputrace cannot hook their gradients
HOOK_REFUSED = """
import torch
def refuse(self, hook):   # a tensor type (or torch build) that takes no gradient hooks
    raise RuntimeError("this tensor takes no post-accumulate-grad hooks")
torch.Tensor.register_post_accumulate_grad_hook = refuse
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for it in range(3):
    loss = model(torch.randn(2, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained", flush=True)
raise SystemExit(6)
"""


@pytest.mark.slow
def test_a_torch_hook_that_fails_is_one_line_and_training_goes_on(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, "-c", HOOK_REFUSED)
    assert p.returncode == 6 and p.stdout == "trained\n", p.stderr
    (line,) = _said(p.stderr)
    assert "torch instrumentation failed" in line and "training goes on" in line
    from gputrace import load

    tr = load(out)
    assert tr.metadata["collectors"]["torch"]["status"].startswith("failed in ")
    assert "update" in tr.table.column("cat").to_pylist()   # the other hooks still record


def test_span_arguments_json_cannot_hold_are_kept_as_text(tmp_path):
    out = tmp_path / "t.arrow"
    p = _run("""
        import sys, gputrace
        with gputrace.Session(sys.argv[1], sampler=False):
            with gputrace.phase("forward", args={"shape": (2, 3), "dtype": object()}):
                pass
        print("done")
    """, str(out))
    assert p.returncode == 0 and p.stdout == "done\n", p.stderr
    assert not _said(p.stderr)
    from gputrace import load

    (args,) = [r["args"] for r in load(out).table.to_pylist() if r["cat"] == "forward"]
    assert '"shape":[2,3]' in args and "object object at" in args
