"""DeepSpeed ZeRO as users run it (tests/jobs/ds_train.py: `deepspeed.initialize`, then
`engine(x)`, `engine.backward(loss)`, `engine.step()`, 2 ranks over gloo on the CPU),
recorded with no change to the job and held against the job's own count of its
collectives and its own clock: stages 1, 2 (with and without overlap_comm) and 3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from gputrace import load  # noqa: E402
from gputrace.analyzers import analyze  # noqa: E402
from gputrace.analyzers.core import collectives as col  # noqa: E402
from gputrace.analyzers.core.frame import build  # noqa: E402
from gputrace.analyzers.parallel.sharded.shardinputs import summarize_rank  # noqa: E402
from gputrace.analyzers.parallel.sharded.zero_whatif import settings  # noqa: E402
from gputrace.analyzers.run.rank_part import rank_steps  # noqa: E402
from tests.truth import matched  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "ds_train.py"
pytestmark = pytest.mark.slow
SKIP = 3
# ds_train.py's MLP at width 512: 1,055,754 gradient elements; a quarter of them is the
# bucket size the one-bucket run (DeepSpeed's default reduce_bucket_size) offers a what-if for
QUARTER = (4 * (512 * 512 + 512) + 512 * 10 + 10) // 4
# a hidden layer's weight: what ZeRO-3 gathers of it (its bias, and the last layer, are under
# stage3_param_persistence_threshold: persistent)
LAYER = 512 * 512
CONFIGS = {"zero1": ["--stage", "1"], "zero2": ["--stage", "2"],
           "zero2-overlap": ["--stage", "2", "--overlap-comm"], "zero3": ["--stage", "3"],
           "zero2-buckets": ["--stage", "2", "--bucket", str(QUARTER)],
           "zero3-layer": ["--stage", "3", "--prefetch-bucket", str(LAYER)]}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            prefix = out / name
            env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(
                x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x))
            p = subprocess.run(
                [sys.executable, "-m", "gputrace", "record", "-q", "-f", "-o",
                 f"{prefix}.arrow", "--", sys.executable, "-m", "torch.distributed.run",
                 "--standalone", "--nproc_per_node", "2", str(JOB), str(prefix),
                 *CONFIGS[name]], capture_output=True, text=True, timeout=600, env=env,
                cwd=str(ROOT))
            assert p.returncode == 0, f"{name}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
            assert "Traceback" not in p.stderr, p.stderr[-5000:]
            truth = {r: json.loads(Path(f"{prefix}.rank{r}.json").read_text())
                     for r in (0, 1)}
            trace = load(f"{prefix}.arrow")
            cache[name] = (trace, truth, analyze(trace))
        return cache[name]

    return get


def _per_iteration_counts(trace, rank: int) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for r in trace.table.to_pylist():
        if r["rank"] == rank and r["kind"] == "span" and r["cat"] == "comm":
            a = json.loads(r["args"] or "{}")
            out.setdefault(r["step"], Counter())[(a.get("kind", r["name"]), r["bytes"])] += 1
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_collectives_are_the_jobs_own(recorded, name):
    """Per iteration, each kind of collective and its bytes, as many as the job issued."""
    trace, truth, _ = recorded(name)
    for rank in (0, 1):
        ours = _per_iteration_counts(trace, rank)
        own: dict[int, Counter] = {}
        for c in truth[rank]["calls"]:
            if c["it"] >= 0:
                own.setdefault(c["it"], Counter())[(c["kind"], c["bytes"])] += 1
        steps = sorted(own)[SKIP:]
        assert len(steps) >= 8
        assert [ours.get(k) for k in steps] == [own[k] for k in steps], (rank, ours, own)


def _mean(truth, key: str) -> float:
    its = truth["iterations"][SKIP:]
    if key == "t_iter":
        return float(np.mean([(i["end"] - i["start"]) / 1e9 for i in its]))
    return float(np.mean([i[key] for i in its]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_phases_are_the_engines(recorded, name):
    """engine(x), engine.backward and engine.step as the job timed them: each phase with
    the collectives it stood in within 15 %, the iteration within 5 %, and almost nothing
    of the iteration in no phase."""
    trace, truth, a = recorded(name)
    frame = build(trace.table, trace.metadata)
    for rank, ra in a.ranks.items():
        b = {k: s.mean for k, s in ra.breakdown.items()}
        sh = ra.sharded
        assert sh is not None and sh.strategy == f"zero{CONFIGS[name][1]}", sh
        # the step's few-byte all-reduces (the overflow flag, the gradient norm); ZeRO-3's
        # few-byte all-gathers fetch small parameters in the forward and backward, not here
        small = sum(k.exposed_s for k in ra.collectives.kinds
                    if k.small and k.kind == "all_reduce")
        ex, side = sh.exposed, sh.exposed_sides
        sel = slice(ra.warmup_skipped, None)
        sp = frame.ranks[rank]
        cr = col.rows(sp)
        rs = rank_steps(sp, cr)

        def small_in(k: int, sp=sp, cr=cr, rs=rs) -> float:  # type: ignore[no-untyped-def]
            """Iteration k's few-byte all-reduces, exposed."""
            return sum(x.exposed_s for x in summarize_rank(sp, cr, rs, np.array([k])).kinds
                       if x.small and x.kind == "all_reduce")

        # the analysis' figures are its iterations' means: each phase's own time, and the
        # collectives exposed in it
        for term, key in (("t_iter", None), ("t_f", "forward"), ("t_b", "backward"),
                          ("t_u", "update")):
            assert b[term] == pytest.approx(float(np.mean(rs.terms[term][sel])), rel=1e-9)
            if key:
                assert ex[f"{key}_s"] == pytest.approx(float(np.mean(side[key])), abs=1e-9)
        # iteration by iteration against the job's own (paired by their clocks, warm-up left
        # out): a preemption at a phase's edge (this suite runs beside busy neighbours)
        # moves one iteration, not the median
        assert small == pytest.approx(float(np.mean([small_in(k) for k in range(
            ra.warmup_skipped, rs.iterations.start.size)])), rel=1e-6, abs=1e-9)
        its = truth[rank]["iterations"]
        first = int(rs.iterations.start.size - side["forward"].size)
        pairs = [(i, k) for i, k in matched(rs, its) if i >= SKIP and k >= first]
        assert len(pairs) >= 8, pairs
        for key, term in (("t_iter", "t_iter"), ("forward", "t_f"), ("backward", "t_b"),
                          ("update", "t_u")):
            got = np.array([rs.terms[term][k] + (side[key][k - first] if key in side else 0.0)
                            + (small_in(k) if key == "update" else 0.0) for _, k in pairs])
            want = np.array([(its[i]["end"] - its[i]["start"]) / 1e9 if key == "t_iter"
                             else its[i][key] for i, _ in pairs])
            tol = 0.05 if key == "t_iter" else 0.15
            gap = float(np.median(got - want))
            assert abs(gap) <= max(tol * float(np.median(want)), 1e-3), \
                (name, rank, key, got.tolist(), want.tolist())
        assert b["t_other"] < 0.10 * b["t_iter"], (name, rank, b)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_headline_and_units(recorded, name):
    """The headline names the stage and the per-iteration collectives; a collective of a few
    bytes (the gradient norm, an overflow flag) is never a unit; nothing absurd."""
    trace, truth, a = recorded(name)
    ra = a.main
    stage = CONFIGS[name][1]
    head = ra.sharded.headline()
    assert head.startswith(f"DeepSpeed ZeRO-{stage}, 2 ranks: "), head
    assert all(u.nbytes >= 1024 for u in ra.sharded.units), ra.sharded.units
    for w in ra.sharded.what_if:
        assert w.withheld or w.t_iter < 3 * ra.breakdown["t_iter"].mean


def _what_if(a, **knobs):
    return [w for w in a.main.sharded.what_if
            if all(w.knobs.get(k) == v for k, v in knobs.items())]


def test_reduce_bucket_size_what_ifs_are_the_buckets_deepspeed_makes(recorded):
    """The one-bucket run's what-if at a quarter of the gradients and the run made with that
    reduce_bucket_size (and back): the buckets the what-if replays are as many per
    iteration as the other run reduced, its figures given (never absurd); the settings are
    read from the engine, DDP's bucket_cap_mb nowhere."""
    _, _, one = recorded("zero2")
    _, _, four = recorded("zero2-buckets")
    measured = {n: a.main.sharded.per_iteration["reduce_grad"] for n, a in
                (("one", one), ("four", four))}
    assert measured["one"] == 1 and measured["four"] > 1, measured
    (w,) = _what_if(one, reduce_bucket_size=QUARTER)
    assert w.knobs["buckets"] == measured["four"], (w, measured)
    (back,) = _what_if(four, reduce_bucket_size=500_000_000)
    assert back.knobs["buckets"] == 1, back
    for a in (one, four):
        labels = [x.label for x in a.main.sharded.what_if]
        assert not any("bucket_cap_mb" in x for x in labels), labels
        for x in a.main.sharded.what_if:
            assert x.withheld is None and x.t_iter > 0, x


def test_overlap_comm_changes_nothing_where_collectives_are_synchronous(recorded):
    """gloo's collectives block the backward whether or not DeepSpeed overlaps them: the
    overlap_comm what-if of either run predicts its own iteration, and says why."""
    for name, flip in (("zero2", True), ("zero2-overlap", False)):
        _, _, a = recorded(name)
        (w,) = _what_if(a, overlap_comm=flip)
        assert w.t_iter == pytest.approx(a.main.breakdown["t_iter"].mean, rel=1e-3), w
        assert any("overlap_comm" in x and "synchronous" in x
                   for x in a.main.sharded.assumptions)


def _own_step_gathers(truth) -> list[tuple[float, float]]:
    """(all-gathers, their bytes) per iteration in the job's own engine.step, as it counted
    them at the ProcessGroup."""
    per: dict[int, list[int]] = {}
    for c in truth[0]["calls"]:
        if c["it"] >= SKIP and c["phase"] == "update" and c["kind"] == "all_gather":
            per.setdefault(c["it"], []).append(c["bytes"])
    return sorted({(len(v), sum(v)) for v in per.values()})


def test_allgather_bucket_size_what_if_is_the_gathers_deepspeed_makes(recorded):
    """The one-bucket run's allgather_bucket_size what-if at a quarter of the gradients and
    the run made with that allgather_bucket_size (zero2-buckets: its reduce_bucket_size,
    which no step gather depends on, changed too): DeepSpeed gathers the updated partition in
    one all_gather_into_tensor whatever the size (recorded with the engine's settings), so
    the what-if predicts the all-gathers the job counted in that run, and no change of the
    iteration."""
    one_trace, _, one = recorded("zero2")
    _, truth_q, _ = recorded("zero2-buckets")
    assert settings(one_trace.metadata)["all_gather_into_tensor"] is True
    (w,) = _what_if(one, allgather_bucket_size=QUARTER)
    ((calls, nbytes),) = _own_step_gathers(truth_q)
    assert w.withheld is None and w.knobs["gathers"] == calls, (w, calls)
    units = [u for u in one.main.sharded.units if u.role == "step_gather"]
    assert sum(u.count for u in units) == calls
    assert sum(u.nbytes for u in units) == nbytes
    assert w.t_iter == pytest.approx(one.main.breakdown["t_iter"].mean, rel=1e-6)


def _own_param_gathers(truth) -> set[int]:
    """The job's own all-gathers of parameters (1 KiB or more) per iteration in its forward
    and backward, as it counted them at the ProcessGroup."""
    per: dict[int, int] = {}
    for c in truth[0]["calls"]:
        if c["it"] >= SKIP and c["phase"] in ("forward", "backward") and \
                c["kind"] == "all_gather" and c["bytes"] >= 1024:
            per[c["it"]] = per.get(c["it"], 0) + 1
    return set(per.values()) or {0}


def test_zero3_prefetch_what_ifs_are_the_gathers_deepspeed_makes(recorded):
    """DeepSpeed's default stage3_prefetch_bucket_size prefetches every parameter at the
    model's first fetch (one all-gather); a bucket of one layer prefetches a layer ahead (one
    per layer). Each run offers the other's setting (and stage3_max_live_parameters),
    replaying DeepSpeed's fetch rule on its recorded fetches: the all-gathers a what-if
    replays are as many per iteration as the run made with that setting, its figures are
    given; the settings are read from the engine."""
    t_def, own_def, a_def = recorded("zero3")
    _, own_lay, a_lay = recorded("zero3-layer")
    ds = settings(t_def.metadata)
    assert ds["stage3_prefetch_bucket_size"] == 50_000_000, ds
    assert ds["stage3_max_live_parameters"] == 1_000_000_000, ds
    assert _own_param_gathers(own_def) == {1} and _own_param_gathers(own_lay) == {4}
    for a, v, n in ((a_def, LAYER, 4), (a_lay, 4 * LAYER, 1), (a_lay, 0, 4)):
        (w,) = _what_if(a, stage3_prefetch_bucket_size=v)
        assert w.withheld is None and w.knobs["gathers"] == n, w
        assert np.isfinite(w.t_iter) and w.t_iter > 0, w
    # the default's budget at one layer live: the first layer prefetched, the others fetched
    (w,) = _what_if(a_def, stage3_max_live_parameters=LAYER)
    assert w.withheld is None and w.knobs["gathers"] == 4, w


def test_zero3_prefetches_are_marked_with_the_layer_they_serve(recorded):
    """A layer ahead: each hidden layer's weight gathered by a prefetch issued in the fetch
    before it, marked so and counted to that layer's unit."""
    _, _, a = recorded("zero3-layer")
    units = [u for u in a.main.sharded.units if u.role == "unshard"]
    assert sorted(u.name for u in units) == ["0", "2", "4", "6"], units
    assert all(u.prefetched == 1.0 and u.count == pytest.approx(1.0) for u in units), units


def test_reduce_bucket_size_what_if_costs_each_call_as_the_job_timed_one(recorded):
    """More buckets are more calls, each costing what a call costs: the one-bucket run's
    what-if at a quarter of the gradients (4 calls more, as the other run made) predicts a
    longer iteration, and the run with that size a shorter one at one bucket, by at least
    half of what those calls took when the job itself timed an all-reduce of 4 bytes after
    its loop (inside the loop, with both ranks computing, a call took longer on this CPU;
    the fastest of its 9 calls, one neither rank was preempted in: beside two CPU hogs the
    median, 1.39 ms, was a preempted call's) and by less than the job's own whole backward;
    the assumptions say what a call costs.
    (Against the measured iterations of the two runs, over
    rounds: bench/whatif_ds.py.)"""
    _, truth1, one = recorded("zero2")
    _, truth4, four = recorded("zero2-buckets")
    extra = four.main.sharded.per_iteration["reduce_grad"] - \
        one.main.sharded.per_iteration["reduce_grad"]
    assert extra >= 3, extra
    for a, truth, size, sign in ((one, truth1, QUARTER, 1), (four, truth4, 500_000_000, -1)):
        (w,) = _what_if(a, reduce_bucket_size=size)
        change = sign * (w.t_iter - a.main.breakdown["t_iter"].mean)
        call = float(np.mean([truth[r]["probe"]["small_min_s"] for r in (0, 1)]))
        backward = _mean(truth[0], "backward")
        assert extra * call / 2 <= change < backward, (w, change, call, backward)
        assert any("ms per call" in x for x in a.main.sharded.assumptions)
