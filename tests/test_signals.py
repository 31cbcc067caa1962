"""Signals from schedulers and scripts: `gputrace record` started as a background job of a
non-interactive shell (which starts it with SIGINT and SIGQUIT ignored), then signalled by
that shell, as batch systems, CI runners and wrappers do."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gputrace import load
from tests.conftest import GPUTRACE

# The job says how it started, says it is ready, waits, and leaves a mark when its own
# cleanup runs (a `finally`, or its own SIGTERM handler).
JOB = textwrap.dedent("""
    import os, signal, sys, time
    here = sys.argv[1]
    if len(sys.argv) > 2:   # a SIGTERM handler of its own, that cleans up and re-raises
        def term(signum, frame):
            open(os.path.join(here, "cleanup"), "w").close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        signal.signal(signal.SIGTERM, term)
    with open(os.path.join(here, "dispositions"), "w") as f:
        f.write(" ".join(str(int(signal.getsignal(s) in (signal.SIG_IGN, None)))
                         for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)))
    open(os.path.join(here, "ready"), "w").close()
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        open(os.path.join(here, "interrupted"), "w").close()
        raise
    finally:
        open(os.path.join(here, "cleanup"), "w").close()
""")


def _in_background(tmp_path: Path, inner: str, signal_name: str, ready: list[str],
                   prelude: str = "") -> tuple[int, str]:
    """Run `inner` as a background job of `bash -c` (no job control), wait until every file
    in `ready` exists, send it `signal_name` with the shell's `kill`, and return what `wait`
    gives and stderr."""
    wait_ready = " ".join(f"[ -e {shlex.quote(str(tmp_path / r))} ] &&" for r in ready)
    script = (f"{prelude}{inner} & pid=$!\n"
              f"for i in $(seq 600); do {wait_ready} break; sleep 0.1; done\n"
              f"kill -{signal_name} $pid\nwait $pid\necho \"rc=$?\"\n")
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    rc = [ln for ln in p.stdout.splitlines() if ln.startswith("rc=")]
    assert rc, p.stdout + p.stderr
    return int(rc[-1][3:]), p.stderr


def _record(tmp_path: Path, *job: str) -> str:
    return shlex.join([*GPUTRACE, "record", "-q", "--kill-after", "30", "-o",
                       str(tmp_path / "t.arrow"), "--", *job])


@pytest.mark.parametrize("sig,code,interrupted", [("INT", 130, True), ("TERM", 143, False)])
def test_signal_from_a_scripts_background_job_stops_the_job_as_without_gputrace(
        tmp_path, sig, code, interrupted):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    rc, err = _in_background(tmp_path, _record(tmp_path, sys.executable, str(job),
                                               str(tmp_path)), sig, ["ready"])
    assert rc == code, err
    assert "SIGKILL" not in err                  # it stopped on the signal, not escalation
    # a direct run from an interactive shell: SIGINT and SIGQUIT at their defaults
    assert (tmp_path / "dispositions").read_text().split()[:2] == ["0", "0"]
    assert (tmp_path / "interrupted").exists() == interrupted
    if interrupted:
        assert (tmp_path / "cleanup").exists()   # its finally ran
    assert load(tmp_path / "t.arrow").metadata["exit_code"] == code


def test_sigterm_runs_the_jobs_own_handler(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    rc, err = _in_background(tmp_path, _record(tmp_path, sys.executable, str(job),
                                               str(tmp_path), "handler"), "TERM", ["ready"])
    assert rc == 143, err
    assert (tmp_path / "cleanup").exists()


def test_a_signal_ignored_on_purpose_stays_ignored(tmp_path):
    """nohup-style: SIGHUP ignored before `record` starts stays ignored by the job."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    rc, err = _in_background(tmp_path, _record(tmp_path, sys.executable, str(job),
                                               str(tmp_path)), "INT", ["ready"],
                             prelude="trap '' HUP\n")
    assert rc == 130, err
    assert (tmp_path / "dispositions").read_text() == "0 0 1"


DDP_JOB = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    here = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    open(os.path.join(here, f"ready{rank}"), "w").close()
    try:
        while True:
            time.sleep(0.05)
    finally:
        open(os.path.join(here, f"cleanup{rank}"), "w").close()
""")


@pytest.mark.slow
def test_sigint_under_torchrun_reaches_both_ranks_as_without_gputrace(tmp_path):
    pytest.importorskip("torch")
    job = tmp_path / "ddp.py"
    job.write_text(DDP_JOB)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", str(job), str(tmp_path)]
    ready = ["ready0", "ready1"]
    direct, _ = _in_background(tmp_path, shlex.join(torchrun), "INT", ready)
    assert {p.name for p in tmp_path.glob("cleanup*")} == {"cleanup0", "cleanup1"}
    for p in [*tmp_path.glob("cleanup*"), *tmp_path.glob("ready*")]:
        p.unlink()
    rc, err = _in_background(tmp_path, _record(tmp_path, *torchrun), "INT", ready)
    assert rc == direct, err                     # torchrun's own answer to SIGINT
    assert "SIGKILL" not in err
    assert {p.name for p in tmp_path.glob("cleanup*")} == {"cleanup0", "cleanup1"}
    tr = load(tmp_path / "t.arrow")
    assert tr.metadata["exit_code"] == direct
    assert set(tr.metadata["ranks"]) == {0, 1}
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".shards")]
