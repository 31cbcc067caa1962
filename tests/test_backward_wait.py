"""DDP's wait at the backward's end for its last all-reduce, to `backward()` returning, is
exposed gradient comm, as the job's own clock has it: tests/jobs/window_loop.py (2-rank gloo
DDP, 24 layers of width 512: 25 MB of gradients, which DDP copies back from its buckets
after the all-reduce) times, per iteration, its wait from its last gradient to `backward()`
returning, and its backward. The all-reduce's span ends before that wait does (the copy
back, the thread's wake-up: 3.5 ms of 23 on this machine, quiet), so without the wait's
tail gputrace's exposed comm was 0.84 of the job's wait and its backward 0.90."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gputrace.analyzers.core.frame import build  # noqa: E402
from gputrace.analyzers.run.rank_part import rank_steps  # noqa: E402
from gputrace.trace import load  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402
from tests.test_window import JOB  # noqa: E402

pytestmark = pytest.mark.slow
TOL = 0.10


def test_ddp_wait_for_its_last_all_reduce_is_exposed_comm_to_backwards_return(tmp_path):
    out, truth = tmp_path / "w.arrow", tmp_path / "w.json"
    p = run_gputrace("record", "-q", "-o", str(out), "--layers", "leaves", "--collectors",
                     "torch", "--", sys.executable, "-m", "torch.distributed.run",
                     "--standalone", "--nproc_per_node", "2", JOB, str(truth),
                     "--iterations", "30", "--width", "512", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    trace = load(out)
    frame = build(trace.table, trace.metadata)
    for rank in (0, 1):
        own = json.loads(Path(str(truth).replace(".json", f".rank{rank}.json")).read_text())
        rs = rank_steps(frame.ranks[rank])
        k = np.arange(3, rs.iterations.step.size)        # warm-up left out
        steps = rs.iterations.step[k]
        assert steps.size >= 20, rs.iterations.step
        wait = np.array([own[s]["grad_wait"] for s in steps])
        job_b = np.array([own[s]["backward"] for s in steps])
        exposed = rs.comm.exposed_s[k]
        # iteration by iteration, the exposed gradient comm over the job's wait for it
        ratio = float(np.median(exposed / wait))
        assert abs(ratio - 1) <= TOL, (rank, ratio, exposed.round(4), wait.round(4))
        # and the backward, its compute and the comm it stood in, over the job's backward()
        ratio = float(np.median((rs.terms["t_b"][k] + exposed) / job_b))
        assert abs(ratio - 1) <= TOL, (rank, ratio)
