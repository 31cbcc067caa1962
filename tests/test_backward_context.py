"""Collectives issued inside a backward over gloo under gputrace leave gloo's thread nothing
that needs the GIL to free: the process cannot abort at its exit because of them.

torch 2.13 stashes a Python object (the backward's `contextvars` context) in the thread's
state for each backward; every collective issued in it copies that state into its Work, and
gloo's own thread, freeing a completed Work, takes the GIL to drop the object. When the
interpreter is already finalizing, that ends the thread through a C++ destructor and the
process aborts: a plain `torchrun` of a DDP job over gloo ending right after its last
backward aborted 5 times in 27 here ("terminate called without an active exception",
exit -6). gputrace issues DDP's buckets, and passes the job's own CPU collectives inside a
backward, without the object (collectors/torch/waiter.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace import load
from tests.conftest import run_gputrace

pytest.importorskip("torch")

JOB = Path(__file__).parent / "jobs" / "backward_context.py"


def _held(p: subprocess.CompletedProcess[str]) -> dict[str, int]:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_no_collective_keeps_the_backwards_context_on_gloos_side(tmp_path):
    """The job's all-reduce from a gradient hook and its DDP comm hook's, Works kept: the
    backward's context has a reference from gloo's side without gputrace (torch's own
    behaviour, which this job sees), none under it; both recorded as comm spans."""
    plain = _held(subprocess.run([sys.executable, str(JOB), str(tmp_path / "store-plain")],
                                 capture_output=True, text=True, timeout=120))
    if plain["own"] == 0 and plain["ddp"] == 0:
        pytest.skip("this torch keeps no Python object in a collective's Work")
    out = tmp_path / "ctx.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, str(JOB),
                     str(tmp_path / "store-rec"), timeout=120)
    held = _held(p)
    assert (held["own"], held["ddp"]) == (0, 0), (plain, held)
    names = [r["name"] for r in load(out).table.to_pylist()
             if r["kind"] == "span" and r["cat"] == "comm"]
    assert (names.count("all_reduce"), names.count("allreduce")) == (3, 3), names  # own, bucket
