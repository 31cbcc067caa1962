"""The end of a DDP backward after its last all-reduce (DDP's copy of the reduced buckets
back into the gradients, whatever else the autograd engine runs there, a preemption of the
job's thread in it) is the backward's, as the job's own clock has it, not time in no phase:
tests/jobs/window_loop.py (2-rank gloo DDP, 24 layers, timing itself) with a sleep of a
known length queued by its first layer's backward hook after DDP's own end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gputrace.analyzers.core.frame import build  # noqa: E402
from gputrace.analyzers.core.steps import analyze_rank  # noqa: E402
from gputrace.trace import load  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402
from tests.test_window import JOB  # noqa: E402

pytestmark = pytest.mark.slow
TAIL_MS = 4.0


def test_the_tail_of_a_ddp_backward_is_backward(tmp_path):
    out, truth = tmp_path / "t.arrow", tmp_path / "t.json"
    p = run_gputrace("record", "-q", "-o", str(out), "--layers", "leaves", "--collectors",
                     "torch", "--", sys.executable, "-m", "torch.distributed.run",
                     "--standalone", "--nproc_per_node", "2", JOB, str(truth),
                     "--iterations", "40", "--tail-ms", str(TAIL_MS), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    trace = load(out)
    frame = build(trace.table, trace.metadata)
    for rank in (0, 1):
        own = json.loads(Path(str(truth).replace(".json", f".rank{rank}.json")).read_text())
        rs = analyze_rank(frame.ranks[rank])
        steps = rs.iterations.step
        assert len(steps) >= 30, steps
        job_b = np.array([own[s]["backward"] for s in steps])
        assert np.median(job_b) > TAIL_MS / 1e3    # the sleep is in the job's backward
        # iteration by iteration, gputrace's backward (its compute and the comm it stood
        # in) over the job's: the median within 5 % (the tail alone is over half of it)
        ratio = (rs.terms["t_b"] + rs.terms["t_comm"]) / job_b
        assert abs(float(np.median(ratio)) - 1) <= 0.05, (rank, np.round(ratio, 2))
        # and the time in no phase is the loop's own bookkeeping between its clock's
        # reads, less than the tail in most iterations
        assert float(np.median(rs.terms["t_other"])) < TAIL_MS / 1e3, rank
