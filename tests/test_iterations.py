"""Iterations tile the loop and phases match the loop's own clock: a real CPU training loop
(tests/jobs/timed_loop.py) times itself with perf_counter, is recorded by `gputrace record`
or profiled by torch.profiler, and gputrace's per-iteration breakdown is compared with what
the loop measured, iteration by iteration."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gputrace import load  # noqa: E402
from gputrace.importers import import_paths  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402
from tests.truth import compare, matched, per_iteration  # noqa: E402

JOB = str(Path(__file__).resolve().parent / "jobs" / "timed_loop.py")
pytestmark = pytest.mark.slow


def run_job(tmp_path: Path, *args: str, record: bool = True):  # type: ignore[no-untyped-def]
    truth_path, out = tmp_path / "truth.json", tmp_path / "t.arrow"
    if record:
        p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, JOB,
                         str(truth_path), *args, timeout=300)
        assert p.returncode == 0, p.stderr
    else:
        import subprocess
        subprocess.run([sys.executable, JOB, str(truth_path), *args], check=True, timeout=300)
    return json.loads(truth_path.read_text()), out


def test_iterations_tile_a_loop_without_a_loader(tmp_path):
    truth, out = run_job(tmp_path, "--steps", "24")
    tr = load(out)
    its = sorted((r for r in tr.table.to_pylist() if r["cat"] == "iteration"),
                 key=lambda r: r["start_ns"])
    assert [r["step"] for r in its] == list(range(24))
    assert {r["name"] for r in its} == {"iteration"}
    # the copy, zero_grad, logging and sleep between two steps all belong to one
    assert all(a["end_ns"] == b["start_ns"] for a, b in zip(its, its[1:], strict=False))
    rs = per_iteration(tr)
    pairs = matched(rs, truth)
    # one iteration = the loop's own iteration, and its phases (paired, iteration by
    # iteration: the loop's boundary is a little after the step, where it takes its time)
    compare(rs, truth, pairs, {"t_iter": [], "t_f": ["forward"], "t_b": ["backward"],
                               "t_u": ["update"]}, 0.15)
    # what runs between phases (the copy, zero_grad, logging, the 1 ms sleep) is time in no
    # phase, not lost and not in a phase: at least the loop's own between-phase time, and
    # beyond it no more than what gputrace's phases leave out of the loop's phase brackets
    # (its hooks run inside them; under load that grows several-fold), both measured in
    # the same iterations
    pairs = pairs[4:]
    other = np.array([rs.terms["t_other"][k] for _, k in pairs])
    own = np.array([truth[i]["other"] + truth[i]["h2d"] for i, _ in pairs])
    left_out = np.array([sum(truth[i][x] for x in ("forward", "backward", "update"))
                         - sum(rs.terms[x][k] for x in ("t_f", "t_b", "t_u"))
                         for i, k in pairs])
    assert float(np.median(other / own)) >= 0.8, (other.tolist(), own.tolist())
    excess = other - own - np.clip(left_out, 0.0, None)
    assert float(np.median(excess)) <= 0.25 * float(np.median(own)), \
        (other.tolist(), own.tolist(), left_out.tolist())


def test_gradient_accumulation_is_one_iteration_per_optimizer_step(tmp_path):
    truth, out = run_job(tmp_path, "--loader", "--accumulate", "4", "--steps", "12")
    tr = load(out)
    its = [r for r in tr.table.to_pylist() if r["cat"] == "iteration"]
    assert len(its) == 12 and {r["name"] for r in its} == {"iteration"}
    rs = per_iteration(tr)
    pairs = matched(rs, truth)
    assert len(pairs) == 12
    # boundaries are the batch requests that follow a step: the loop's own iteration
    # (step end to step end) is the same length in the steady state
    compare(rs, truth, pairs, {"t_iter": [], "t_io": ["io"], "t_f": ["forward"],
                               "t_b": ["backward"]}, 0.15)


def test_evaluation_batches_are_not_training_iterations(tmp_path):
    truth, out = run_job(tmp_path, "--loader", "--eval-every", "4", "--steps", "12")
    rows = sorted(load(out).table.to_pylist(), key=lambda r: r["start_ns"])
    its = [r for r in rows if r["cat"] == "iteration"]
    # steps are the optimizer's: evaluation batches count none
    assert [r["step"] for r in its] == list(range(12))
    assert {r["name"] for r in its} == {"iteration"}
    ev = [r for r in rows if r["cat"] == "evaluation"]
    # three evaluation batches after steps 4, 8 and 12; the run's very last batch has no
    # next request to end it and is left out; the batches in a row are one pass
    assert sum(r["name"] == "batch" for r in ev) == 3 + 3 + 2
    passes = [r for r in ev if r["name"] == "pass"]
    assert [json.loads(r["args"])["batches"] for r in passes] == [3, 3, 2]
    # each pass lies between the iterations of the steps the loop ran it between
    for k, ps in zip((3, 7, 11), passes, strict=False):
        assert its[k]["end_ns"] <= ps["start_ns"]
        if k + 1 < len(its):
            assert ps["end_ns"] <= its[k + 1]["start_ns"]
    p = run_gputrace("analyze", str(out), "--json", check=True)
    assert json.loads(p.stdout)["iterations"]["count"] == 12


def test_a_loop_without_an_optimizer_has_an_iteration_per_pass(tmp_path):
    truth, out = run_job(tmp_path, "--no-optimizer", "--steps", "10")
    its = [r for r in load(out).table.to_pylist() if r["cat"] == "iteration"]
    assert len(its) == 10


def test_torch_profiler_trace_of_a_cpu_loop_has_every_phase(tmp_path):
    """A trace PyTorch made itself (CPU only, no module ranges): forward and backward are
    found from its operators, and match the loop's own clock."""
    prof = tmp_path / "prof.json"
    truth, _ = run_job(tmp_path, "--loader", "--steps", "16", "--profile", str(prof),
                       record=False)
    tr = import_paths([str(prof)])
    rs = per_iteration(tr)
    pairs = matched(rs, truth)
    compare(rs, truth, pairs, {"t_iter": [], "t_io": ["io"], "t_f": ["forward"],
                               "t_b": ["backward"], "t_u": ["update"]}, 0.15)
    rows = tr.table.to_pylist()
    assert any(r["name"] == "forward (inferred)" for r in rows)
