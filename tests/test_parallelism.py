"""Tensor, pipeline and expert parallelism recorded as users run them: real multi-rank jobs over
gloo on the CPU under `gputrace record` (tests/jobs: tp_train.py with DTensor's
parallelize_module, alone and under FSDP2 on a 2-D mesh; pp_train.py with
torch.distributed.pipelining's GPipe and 1F1B; moe_exchange.py's all-to-alls with a hot
expert), each held to the job's own count of its collectives (at the ProcessGroup:
collective_truth; DTensor's functional ones from PyTorch's profiler: comm_clock) and its
own clock (its iterations, the time it stood in its TP collectives, each pipeline stage's
compute per microbatch); warm-up left out of the timings, medians over iterations. Then
hand-made traces for the rules real jobs here cannot show: the names of mesh dimensions and
process groups, a DTensor redistribution on an unnamed mesh, a collective whose
parallelism cannot be told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from gputrace import load  # noqa: E402
from gputrace.analyzers import analyze  # noqa: E402
from gputrace.analyzers.parallel.pp import pipesim  # noqa: E402
from gputrace.report.json import to_dict  # noqa: E402
from tests.tracebuilder import Builder  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"
PY = sys.executable
WARMUP, ITER_TOL, TIME_TOL, BYTES_TOL = 3, 0.05, 0.15, 0.01

# name -> (job, ranks, its arguments)
CONFIGS = {
    "tp": ("tp_train.py", 2, ()),
    "fsdp-tp": ("tp_train.py", 4, ("--fsdp", "--iterations", "10")),
    "gpipe-4": ("pp_train.py", 2, ("--schedule", "gpipe", "--microbatches", "4")),
    "1f1b-4": ("pp_train.py", 2, ("--schedule", "1f1b", "--microbatches", "4")),
    "moe": ("moe_exchange.py", 2, ("--hot", "0.75")),
}
# the per-run pipeline tests: both schedules at 4 microbatches (GPipe at 8 is the same code
# with a larger count; the serial part records it, and test_pipeline_schedules 8 microbatches)
PIPELINES = ("gpipe-4", "1f1b-4")
SCHEDULE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def _env() -> dict[str, str]:
    """This tree's gputrace in every process the job starts, wherever the tests run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([PY, "-m", "gputrace", *args], capture_output=True, text=True,
                       timeout=timeout, env=_env())
    assert p.returncode == 0, f"gputrace {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


@dataclass
class Run:
    """One recorded job: its trace, each rank's own truth, `analyze --json` and the terminal
    report, the analysis (per-iteration figures) and each rank's comm and pipeline spans."""

    trace: Any
    truth: dict[int, dict]
    doc: dict
    text: str
    analysis: Any
    comm: dict[int, list[dict]] = field(default_factory=dict)
    pipeline: dict[int, list[dict]] = field(default_factory=dict)
    arrow: str = ""

    def rank(self, r: int) -> dict:
        return self.doc["ranks"][str(r)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Each job recorded once for the module."""
    out = tmp_path_factory.mktemp("parallel")
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            script, ranks, args = CONFIGS[name]
            cache[name] = record_run(out / name, script, ranks, args)
        return cache[name]

    return get


def record_run(prefix: Path, script: str, ranks: int, args: Any) -> Run:
    """`script` (of tests/jobs) recorded under torchrun with `ranks` ranks, its own truth,
    its analysis and its comm and pipeline spans."""
    arrow = f"{prefix}.arrow"
    p = _cli("record", "-q", "-o", arrow, "--", PY, "-m", "torch.distributed.run",
             "--standalone", "--nproc_per_node", str(ranks), str(JOBS / script),
             str(prefix), *args)
    assert "Traceback" not in p.stderr, p.stderr[-5000:]
    trace = load(arrow)
    run = Run(trace, {r: json.loads(Path(f"{prefix}.rank{r}.json").read_text())
                      for r in range(ranks)},
              json.loads(_cli("analyze", arrow, "--json").stdout),
              _cli("analyze", arrow).stdout, analyze(trace, detail=True), arrow=arrow)
    for r in trace.table.to_pylist():
        if r["kind"] == "span" and r["cat"] in ("comm", "pipeline"):
            r["a"] = json.loads(r["args"]) if r["args"] else {}
            getattr(run, r["cat"]).setdefault(r["rank"], []).append(r)
    return run


def inside(spans: list[dict], it: dict) -> list[dict]:
    """The spans that began in the job's iteration `it`, in order."""
    return sorted((r for r in spans if it["start"] <= r["start_ns"] <= it["end"]),
                  key=lambda r: r["start_ns"])


def same_collectives(mine: list[dict], want: list[dict], where: Any) -> None:
    """gputrace's spans and the job's own calls: the same (kind, phase) as many times, and
    each one's bytes within 1 %."""
    got, exp = defaultdict(list), defaultdict(list)
    for r in mine:
        got[(r["name"], r["a"]["phase"])].append(r["bytes"])
    for c in want:
        exp[(c["kind"], c["phase"])].append(c["bytes"])
    assert {k: len(v) for k, v in got.items()} == {k: len(v) for k, v in exp.items()}, where
    for k, b in exp.items():
        for x, y in zip(sorted(got[k]), sorted(b), strict=True):
            assert abs(x - y) <= BYTES_TOL * y, (where, k, x, y)


def per_iteration(run: Run, rank: int, got: dict[str, np.ndarray],
                  want: list[dict]) -> dict[str, np.ndarray]:
    """gputrace's per-iteration figures `got` (term -> array over its iterations) beside the
    job's own iterations `want` (with start/end ns), warm-up left out: term -> (gputrace's,
    the job's iteration lengths) over the matched iterations (the analyzed iteration that
    overlaps each of the job's most)."""
    s = run.analysis.ranks[rank].detail.series
    idx = []
    for i, t in enumerate(want):
        ov = np.minimum(s.end_ns, t["end"]) - np.maximum(s.start_ns, t["start"])
        k = int(np.argmax(ov))
        if ov[k] > 0.5 * (t["end"] - t["start"]):
            idx.append((i, k))
    idx = idx[WARMUP:]
    assert len(idx) >= 6, (rank, len(idx), len(want))
    out = {k: np.array([v[j] for _, j in idx]) for k, v in got.items()}
    out["job"] = np.array([i for i, _ in idx])
    return out


def held(got: np.ndarray, want: np.ndarray, tol: float, what: Any) -> float:
    """The median ratio of gputrace's figure to the job's, within `tol`."""
    ratio = float(np.median(got / want))
    assert abs(ratio - 1) <= tol, (what, ratio, got.round(4).tolist(), want.round(4).tolist())
    return ratio


def t_iter_on_the_jobs_clock(run: Run, rank: int) -> float:
    its = run.truth[rank]["iterations"]
    s = run.analysis.ranks[rank].detail.series
    m = per_iteration(run, rank, {"t_iter": s.terms["t_iter"]}, its)
    want = np.array([(its[i]["end"] - its[i]["start"]) / 1e9 for i in m["job"]])
    # an iteration boundary drawn at another instant on the two clocks (a preemption between
    # the job's clock and the step gputrace sees) moves time between neighbours, not out of
    # their sum: held over each two consecutive iterations (beside two CPU hogs, single
    # iterations' ratios spread 0.69-1.31 around a sum's 0.99)
    pair = np.flatnonzero(np.diff(m["job"]) == 1)
    got = m["t_iter"]
    return held(got[pair] + got[pair + 1], want[pair] + want[pair + 1], ITER_TOL,
                (rank, "t_iter"))


# -- tensor parallelism ------------------------------------------------------------------
def tp_truth(t: dict) -> dict[int, list[dict]]:
    """The job's own functional collectives (DTensor's) per iteration."""
    out = defaultdict(list)
    for c in t["functional"]:
        out[c["it"]].append(c)
    return out


def blocks_per_iteration(own: dict[int, list[dict]]) -> dict[tuple[str, int], float]:
    """(phase, block) -> the job's functional collectives per iteration: every block's
    forward all-reduce; in the backward the blocks whose input needs a gradient (2-6: the
    first block's input is the batch)."""
    n = Counter((c["phase"], c["block"]) for i in own for c in own[i])
    want = {k: v / len(own) for k, v in n.items()}
    assert want == {**{("forward", b): 1 for b in range(1, 7)},
                    **{("backward", b): 1 for b in range(2, 7)}}
    return want


def test_tp_collectives_as_the_job_counts_them(recorded):
    """Per iteration and rank, DTensor's all-reduces are the job's own: as many, of the
    same kinds, forward and backward apart, bytes within 1 %; all of them tensor parallel on
    the mesh's "tp" dimension, none a gradient unit; --json's tensor_parallel per phase and
    kind says as much per iteration."""
    run = recorded("tp")
    for rank in (0, 1):
        t = run.truth[rank]
        own = tp_truth(t)
        counts = []
        for it in t["iterations"]:
            mine = inside(run.comm[rank], it)
            assert all(r["a"].get("functional") and r["a"].get("issuer") == "dtensor"
                       for r in mine), [r["a"] for r in mine if not r["a"].get("functional")]
            assert not [c for c in t["calls"] if c["it"] == it["it"]]
            same_collectives(mine, own[it["it"]], (rank, it["it"]))
            for r in mine:
                assert r["a"]["group"]["size"] == 2 and r["a"]["group"]["mesh"]["dim"] == "tp"
            counts.append(Counter((c["phase"], c["kind"]) for c in own[it["it"]]))
        # what the job issues per iteration (the same every iteration): 6 forward, 5 backward
        assert all(c == counts[0] for c in counts), counts
        per_it = counts[0]
        assert per_it == {("forward", "all_reduce"): 6, ("backward", "all_reduce"): 5}
        nbytes = {ph: float(np.mean([sum(c["bytes"] for c in own[i] if c["phase"] == ph)
                                     for i in own])) for ph in ("forward", "backward")}
        d = run.rank(rank)
        tp = d["parallelism"]["tensor_parallel"]
        assert tp["degree"] == 2 and tp["mesh_dim"] == "tp"
        for ph in ("forward", "backward"):
            assert tp["phases"][ph]["count"] == pytest.approx(per_it[(ph, "all_reduce")])
            assert tp["phases"][ph]["bytes"] == pytest.approx(nbytes[ph], rel=BYTES_TOL)
        assert set(tp["phases"]) == {"forward", "backward"}
        assert set(tp["kinds"]) == {"all_reduce"}
        assert tp["count"] == pytest.approx(sum(per_it.values()))
        ar = d["collectives"]["kinds"]["all_reduce"]
        assert set(ar["parallelism"]) == {"tp"} and not ar["gradient"]
        assert d["units"] == []
        assert d["parallelism"]["degrees"] == {"tp": 2}


def test_tp_iteration_and_exposed_comm_on_the_jobs_clock(recorded):
    """t_iter within 5 % of the job's own iteration; the exposed TP comm (t_tp) within 15 %
    of the time the job's thread stood in its functional collectives (PyTorch's profiler),
    median over iterations, per rank."""
    run = recorded("tp")
    for rank in (0, 1):
        t = run.truth[rank]
        t_iter_on_the_jobs_clock(run, rank)
        stood = defaultdict(float)
        for x in t["stood"]:
            stood[x["it"]] += x["s"]
        s = run.analysis.ranks[rank].detail.series
        m = per_iteration(run, rank, {"t_tp": s.terms["t_tp"]}, t["iterations"])
        want = np.array([stood[t["iterations"][i]["it"]] for i in m["job"]])
        held(m["t_tp"], want, TIME_TOL, (rank, "t_tp"))


def test_tp_headline_and_no_data_parallel_predictions(recorded):
    """The headline names TP and its degree; no data-parallel speedup table and no bucket
    what-if, each withheld with the reason; never "single process"."""
    run = recorded("tp")
    head = run.text.splitlines()[0]
    assert "TP 2, 2 ranks" in head and "TP 11 all-reduces per iteration" in head, head
    assert "single process" not in run.text
    assert run.doc["parallelism"]["dimensions"] == "TP 2, 2 ranks"
    for d in (run.doc, *run.doc["ranks"].values()):
        assert d["speedup"]["points"] == []
        assert "tensor parallel communication" in d["speedup"]["unavailable"]
        assert d["what_if"] is None
        assert "tensor parallel communication" in d["what_if_unavailable"]
    assert "Predicted speedup: not computed (tensor parallel communication" in run.text
    assert "What if: not replayed: tensor parallel communication" in run.text
    assert "Predicted speedup (eq." not in run.text
    # throughput: the 2 TP ranks take the same 128 samples: one replica, not doubled
    tp = run.doc["throughput"]
    assert tp["samples_per_iteration"] == pytest.approx(128)
    assert tp["job"]["replicas"] == 1
    ranks = [d["throughput"]["samples_per_s"] for d in run.doc["ranks"].values()]
    assert tp["job"]["samples_per_s"] == pytest.approx(float(np.mean(ranks)))


def test_tp_per_layer_attribution_is_the_jobs_blocks(recorded):
    """Each TP collective on the layer (block 1..6 from the input side) the job says issued
    it: every block its forward all-reduce; in the backward the 5 blocks whose input needs a
    gradient (blocks 2-6: the first block's input is the batch), each its input gradient's
    all-reduce, which runs after that block's last parameter gradient."""
    run = recorded("tp")
    for rank in (0, 1):
        want = blocks_per_iteration(tp_truth(run.truth[rank]))
        layers = run.rank(rank)["parallelism"]["tensor_parallel"]["layers"]
        got = {(x["phase"], x["layer"]): x["count"] for x in layers}
        assert got == pytest.approx(want), (rank, sorted(got))
        assert {x["name"] for x in layers} == {"MLP"}


# -- FSDP x TP ----------------------------------------------------------------------------
def test_fsdp_tp_one_breakdown_each_dimension_its_own(recorded):
    """FSDP2 over "dp" and TP over "tp" on a 2x2 mesh: per iteration and rank, FSDP's
    all-gathers and reduce-scatters (at the ProcessGroup) and DTensor's all-reduces (the
    profiler) as the job counts them; one breakdown with a row for each (t_comm: FSDP's
    comm in the sharded analysis; t_tp), TP's all-reduces on the job's blocks (a layer's
    backward ends at FSDP's post-backward here); FSDP's units only its own collectives; the
    headline names both dimensions and their degrees."""
    run = recorded("fsdp-tp")
    fsdp_per_it = None
    for rank in range(4):
        t = run.truth[rank]
        own = tp_truth(t)
        for it in t["iterations"]:
            mine = inside(run.comm[rank], it)
            fc = [r for r in mine if r["a"].get("functional")]
            c10d = [r for r in mine if not r["a"].get("functional")]
            same_collectives(fc, own[it["it"]], (rank, it["it"], "tp"))
            calls = [c for c in t["calls"] if c["it"] == it["it"]]
            same_collectives(c10d, calls, (rank, it["it"], "fsdp"))
            assert {r["a"]["group"]["mesh"]["dim"] for r in fc} == {"tp"}
            assert {r["a"]["group"]["mesh"]["dim"] for r in c10d} == {"dp"}
            assert all(r["a"].get("fsdp") == "fsdp2" for r in c10d)
            n = Counter(c["kind"] for c in calls)
            assert fsdp_per_it is None or n == fsdp_per_it
            fsdp_per_it = n
        d = run.rank(rank)
        kinds = d["collectives"]["kinds"]
        assert set(kinds["all_reduce"]["parallelism"]) == {"tp"}
        assert set(kinds["all_gather"]["parallelism"]) == {"fsdp"}
        assert set(kinds["reduce_scatter"]["parallelism"]) == {"fsdp"}
        assert kinds["all_reduce"]["count"] == pytest.approx(11)
        # FSDP's units: its own all-gathers and reduce-scatters, every one of them
        sh = d["sharded"]
        assert sh["kinds"] == pytest.approx(dict(fsdp_per_it))
        assert {u["kind"] for u in sh["units"]} == {"all_gather", "reduce_scatter"}
        assert {u["kind"] for u in d["units"]} == {"all_gather", "reduce_scatter"}
        assert len(d["units"]) == sum(fsdp_per_it.values())
        # one breakdown: FSDP's comm and TP's exposed comm, each its row
        b = d["breakdown"]
        assert b["t_comm"]["mean"] > 0 and b["t_tp"]["mean"] > 0
        assert d["parallelism"]["terms"]["t_tp"] == pytest.approx(b["t_tp"]["mean"])
        tp = d["parallelism"]["tensor_parallel"]
        assert tp["phases"]["forward"]["count"] == pytest.approx(6)
        assert tp["phases"]["backward"]["count"] == pytest.approx(5)
        assert {(x["phase"], x["layer"]): x["count"] for x in tp["layers"]} == \
            pytest.approx(blocks_per_iteration(own))
        assert d["parallelism"]["degrees"] == {"fsdp": 2, "tp": 2}
        assert d["parallelism"]["dimensions"] == "FSDP 2 x TP 2, 4 ranks"
    assert fsdp_per_it == {"all_gather": 12, "reduce_scatter": 6}
    head = run.text.splitlines()[0]
    assert "FSDP 2 x TP 2, 4 ranks" in head, head
    lines = run.text.splitlines()
    for term in ("t_comm", "t_tp"):
        assert any(ln.strip().startswith(term) for ln in lines), term
    assert "single process" not in run.text


def test_fsdp_tp_iteration_on_the_jobs_clock(recorded):
    run = recorded("fsdp-tp")
    for rank in range(4):
        t_iter_on_the_jobs_clock(run, rank)


# -- pipeline parallelism ----------------------------------------------------------------
def stage_of(run: Run, rank: int) -> dict:
    return run.truth[rank]["stage"]


@pytest.mark.parametrize("name", PIPELINES)
def test_pp_send_recv_as_the_job_counts_them(recorded, name):
    """Per iteration and rank, the sends and receives between the stages are the job's own:
    as many (a batch_isend_irecv is one record of several: its `ops`), 2 per microbatch
    after the first step (which also sends the shapes), the bytes sent and received within
    1 %; every one of them pipeline parallel, from the rank's stage; the stages' table says
    2 per microbatch."""
    run = recorded(name)
    for rank in (0, 1):
        t = run.truth[rank]
        m = stage_of(run, rank)["microbatches"]
        for it in t["iterations"]:
            mine = inside(run.comm[rank], it)
            calls = [c for c in t["calls"] if c["it"] == it["it"]]
            assert {r["name"] for r in mine} == {c["kind"] for c in calls} == {"send_recv"}
            ops = sum(r["a"].get("ops", 1) for r in mine)
            assert ops == len(calls), (rank, it["it"], ops, len(calls))
            if it["it"] > 0:
                assert ops == 2 * m
            sent, got = sum(r["bytes"] for r in mine), sum(c["bytes"] for c in calls)
            assert abs(sent - got) <= BYTES_TOL * got, (rank, it["it"], sent, got)
            recv = sum(r["a"]["bytes_out"] for r in mine)
            want = sum(c.get("bytes_out", 0) for c in calls)
            assert abs(recv - want) <= BYTES_TOL * want, (rank, it["it"], recv, want)
            assert all(r["a"]["pp"] == {"stage": rank} for r in mine)
        d = run.rank(rank)
        sr = d["collectives"]["kinds"]["send_recv"]
        assert set(sr["parallelism"]) == {"pp"} and not sr["gradient"]
        assert d["units"] == []
        (st,) = [s for s in d["parallelism"]["pipeline"]["stages"] if s["rank"] == rank]
        assert st["p2p_count"] == pytest.approx(2 * m)
        assert st["stage"] == rank


@pytest.mark.parametrize("name", PIPELINES)
def test_pp_bubble_and_iteration_on_the_stages_clocks(recorded, name):
    """Per stage: t_iter within 5 % of the job's iteration; the bubble (t_pp) within 15 % of
    what the stage measured itself: its schedule step less its microbatches' passes and its
    loss (the last stage); median over iterations."""
    stages_clocks(recorded(name))


def stages_clocks(run: Run) -> None:
    """Each of the 2 stages: t_iter on the job's clock, and the bubble (t_pp) within
    TIME_TOL of its step less its microbatches' passes as the job timed them (the module's
    forward or autograd and the schedule's work around it: the stage computing) and its
    loss. DeepSpeed's engine also steps its optimizer inside the step (its loss is inside
    its forward pass): its update's all-reduces wait for the other stage (the pipeline's
    waits), the rest is the update, never the bubble: t_pp + t_u is the step less the
    passes, and t_u at most the job's update."""
    for rank in (0, 1):
        t = run.truth[rank]
        t_iter_on_the_jobs_clock(run, rank)
        s = run.analysis.ranks[rank].detail.series
        m = per_iteration(run, rank, {"t_pp": s.terms["t_pp"], "t_u": s.terms["t_u"]},
                          t["iterations"])
        its = [t["iterations"][i] for i in m["job"]]
        if "update_s" not in its[0]:
            want = np.array([it["step_s"] - it["passes_s"] - it["loss_s"] for it in its])
            held(m["t_pp"], want, TIME_TOL, (rank, "t_pp"))
            continue
        want = np.array([it["step_s"] - it["passes_s"] for it in its])
        held(m["t_pp"] + m["t_u"], want, TIME_TOL, (rank, "t_pp + t_u"))
        upd = np.array([it["update_s"] for it in its])
        assert np.median(m["t_u"]) > 0 and np.median(m["t_u"] / upd) <= 1 + TIME_TOL, \
            (rank, m["t_u"].round(4).tolist(), upd.round(4).tolist())


@pytest.mark.parametrize("name", PIPELINES)
def test_pp_headline_and_the_schedules_runtime_order(recorded, name):
    """The headline says "pipeline, 2 stages x M microbatches (GPipe|1F1B)"; in every step,
    each stage's microbatch actions (its `pipeline` spans) come in the order pipesim
    replays for that schedule: the replay's orders are torch's runtime orders."""
    run = recorded(name)
    sched = SCHEDULE[stage_of(run, 0)["schedule"]]
    m = stage_of(run, 0)["microbatches"]
    head = run.text.splitlines()[0]
    assert f"pipeline, 2 stages x {m} microbatches ({pipesim.SHORT[sched]})" in head, head
    assert "PP 2, 2 ranks" in head and "single process" not in run.text
    pl = run.doc["parallelism"]["pipeline"]
    assert (pl["schedule"], pl["microbatches"], pl["num_stages"]) == (sched, m, 2)
    for rank in (0, 1):
        spans = run.pipeline[rank]
        steps = sorted((r for r in spans if r["name"] == "step"), key=lambda r: r["start_ns"])
        assert len(steps) == len(run.truth[rank]["iterations"])
        want = pipesim.order(sched, rank, 2, m)
        for st in steps:
            assert st["a"]["schedule"] == sched and st["a"]["stages"] == [rank]
            mine = sorted((r for r in spans if r["name"] in ("forward", "backward")
                           and st["start_ns"] <= r["start_ns"] <= st["end_ns"]),
                          key=lambda r: r["start_ns"])
            acts = [(r["name"][0].upper(), r["a"]["mb"]) for r in mine]
            assert acts == want, (rank, acts, want)
            assert all(r["a"]["stage"] == rank for r in mine)
        # the job's own microbatches: m forwards and m backwards timed per step (the first
        # step's shape inference runs the stage's forward once more)
        n = Counter(mb["it"] for mb in run.truth[rank]["microbatches"] if mb["it"] > 0)
        assert set(n.values()) == {m}
    # throughput: each stage takes the batch's 256 samples as m microbatches; one replica
    tp = run.doc["throughput"]
    assert tp["forwards_per_iteration"] == pytest.approx(m)
    assert tp["samples_per_iteration"] == pytest.approx(256)
    assert tp["job"]["replicas"] == 1


# GPipe at 4 and 8 microbatches, each recording running both counts in one process (A B A)
BLOCK, SETTLE = 7, 2


@dataclass
class Blocks:
    """One recording of pp_train.py running BLOCK iterations at A microbatches, BLOCK at B and
    BLOCK at A again, the first block in full detail after SETTLE iterations
    (`--steps SETTLE:BLOCK-SETTLE`): its trace and, per block, the job's own iterations on
    stage 0's rank less each block's first SETTLE (a new schedule's first step infers its
    shapes)."""

    arrow: str
    blocks: list[list[float]]

    def median(self, k: int) -> float:
        return float(np.median(self.blocks[k]))


@pytest.fixture(scope="module")
def gpipe_blocks(tmp_path_factory):
    """GPipe recorded at 4, 8, 4 microbatches and at 8, 4, 8 (each recorded when first
    asked for, keyed by its first block's count): each count runs in both recordings, so
    the two say how far the machine's speed moved between them, and the third block how
    far it moved inside one."""
    out = tmp_path_factory.mktemp("gpipe-blocks")
    cache: dict[int, Blocks] = {}

    def get(a: int) -> Blocks:
        if a in cache:
            return cache[a]
        b = 12 - a   # the other count: 4 <-> 8
        prefix = out / f"gpipe-{a}-{b}"
        arrow = f"{prefix}.arrow"
        _cli("record", "-q", "-o", arrow, "--steps", f"{SETTLE}:{BLOCK - SETTLE}", "--", PY,
             "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(JOBS / "pp_train.py"), str(prefix), "--schedule", "gpipe",
             "--microbatches", str(a), "--then", f"{b},{a}", "--iterations", str(BLOCK))
        its = json.loads(Path(f"{prefix}.rank0.json").read_text())["iterations"]
        assert [i["microbatches"] for i in its] == [a] * BLOCK + [b] * BLOCK + [a] * BLOCK
        cache[a] = Blocks(arrow, [[(i["end"] - i["start"]) / 1e9
                                   for i in its[k * BLOCK + SETTLE:(k + 1) * BLOCK]]
                                  for k in range(3)])
        return cache[a]

    return get


@pytest.mark.serial
def test_pp_what_if_fitted_with_a_run_at_another_microbatch_count(gpipe_blocks, tmp_path):
    """`analyze X --calibrate Y`, X's window at 4 microbatches and Y's at 8: each stage's
    compute per microbatch fitted as fixed + per-sample through the two, and the schedule's
    own work per microbatch and the transfer taken through the two runs' own, so that the
    what-if at 8 replays Y's pipeline (X's own work carried to 8 microbatches had put it
    24 % above the run it predicts, where the machine's speed had moved 0.5 %): within 5 %
    of Y's iterations analyzed, on the job's clock. And held to X's own 8-microbatch block
    (its median) within those 5 % plus how far the machine's speed moved meanwhile, as the
    job measures it: the same configuration in the two recordings (8 microbatches: Y's
    iterations analyzed against X's block) and inside X (4 microbatches: its third block
    against its first; X's time outside the step is carried, and its compute where a fit
    is clipped). A fixed bound failed beside a CPU hog: one run 2.5x slower than the other.
    A run at the same count is no calibration (said, not used); one with no pipeline (2
    ranks with a tensor-parallel all-reduce, made by hand) is a command error."""
    x, y = gpipe_blocks(4), gpipe_blocks(8)
    doc = json.loads(_cli("analyze", x.arrow, "--calibrate", y.arrow, "--json").stdout)
    pl = doc["parallelism"]["pipeline"]
    c = pl["compute"]
    assert (c["model"], c["calibrated_with"]) == ("fitted", 8)
    assert "calibrating run at 8 microbatches" in pl["assumptions"][0]
    assert [q["microbatches"] for q in c["schedule_own_at"]] == [4, 8]
    ydoc = json.loads(_cli("analyze", y.arrow, "--json").stdout)
    own = ydoc["parallelism"]["pipeline"]
    assert own["microbatches"] == 8
    clipped = False
    for k, (f, b) in enumerate(zip(c["forward"], c["backward"], strict=True)):
        st = next(s for s in own["stages"] if s["stage"] == k)
        assert f["fixed_s"] >= 0 and f["per_batch_s"] >= 0
        for part, want in ((f, st["forward_s"]), (b, st["backward_s"])):
            if part["fixed_s"] > 0 and part["per_batch_s"] > 0:   # not clipped at 0
                assert part["fixed_s"] + part["per_batch_s"] / 8 == pytest.approx(want,
                                                                                  rel=1e-6)
            else:
                clipped = True
    (w,) = [w for w in pl["what_if"] if w["microbatches"] == 8
            and w["schedule"] == "ScheduleGPipe"]
    y8 = float(np.mean(y.blocks[0][-ydoc["iterations"]["analyzed"]:]))
    drift = abs(y8 / x.median(1) - 1) + abs(x.median(2) / x.median(0) - 1)
    assert abs(w["t_iter"] / y8 - 1) <= ITER_TOL + (drift if clipped else 0), \
        (w["t_iter"], y.blocks, clipped)
    err = w["t_iter"] / x.median(1) - 1
    assert abs(err) <= ITER_TOL + drift, (w["t_iter"], x.blocks, y.blocks, err, drift)
    text = _cli("analyze", x.arrow, "--calibrate", y.arrow).stdout
    assert "fitted with the run at 8 microbatches" in text
    same = json.loads(_cli("analyze", x.arrow, "--calibrate", x.arrow, "--json").stdout)
    c = same["parallelism"]["pipeline"]["compute"]
    assert c["model"] == "proportional" and "same 4 microbatches" in c["calibration_unused"]
    no_pipeline = two_ranks(tmp_path / "tp.arrow",
                            [("all_reduce", "forward", 5, 8, mesh("tp"))])
    p = subprocess.run([PY, "-m", "gputrace", "analyze", x.arrow, "--calibrate",
                        str(no_pipeline)], capture_output=True, text=True, env=_env())
    assert p.returncode == 2 and "no pipeline in it" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


@pytest.mark.serial
def test_pp_microbatch_what_if_within_its_measured_band(gpipe_blocks):
    """One run, no --calibrate, as bench/whatif_pp_inside.py measures it: the first block's
    window (4 microbatches) and its what-if at 8 against the second block's iterations on
    the job's own clock: within the measured error the what-if is given with (its `band`:
    pp_whatif.BAND's, to more microbatches; the terminal's `measured error` column) of
    the fastest and the slowest of them, widened by the machine's drift the job measured. The replay of the recorded configuration gives
    the window's t_iter on the job's clock within 5 %, the schedule's own work per
    microbatch in it; no band on it."""
    from gputrace.analyzers.parallel.pp import pp_whatif

    x = gpipe_blocks(4)
    pl = analyze(load(x.arrow), skip=0).main.parallel["pp"]
    assert (pl.schedule, pl.microbatches) == ("ScheduleGPipe", 4)
    own = pp_whatif.predict(pl, pl.schedule, 4)
    window = float(np.mean(x.blocks[0]))
    assert own.band is None and abs(own.t_iter / window - 1) <= ITER_TOL, \
        (own.t_iter, window)
    assert all(f > 0 and b > 0 for f, b in pl.own), pl.own
    (w,) = [w for w in pl.what_if if w.microbatches == 8 and w.schedule == pl.schedule]
    assert w.band == pp_whatif.BAND["more"]
    lo, hi = w.band
    # the run at 8 is the job's second block, whose own iterations moved with the machine
    # (0.059-0.089 s at one configuration in one quiet run): the band around the fastest
    # and the slowest of them, widened by how far the machine's speed moved inside the
    # recording at one configuration (the third block, 4 microbatches again, against the
    # window's)
    drift = abs(x.median(2) / x.median(0) - 1)
    low = min(x.blocks[1]) * (1 + lo - drift)
    high = max(x.blocks[1]) * (1 + hi + drift)
    assert low <= w.t_iter <= high, (w.t_iter, x.blocks, (lo, hi), drift)
    text = _cli("analyze", x.arrow).stdout
    assert "measured error" in text and f"{lo:+.0%} .. {hi:+.0%}" in text


# -- expert parallelism -------------------------------------------------------------------
def test_moe_all_to_alls_are_expert_parallel(recorded):
    """A hot expert (each rank routes 3/4 of its tokens to rank 0's): the all-to-alls are
    expert parallel, never gradient units; per rank the dispatch and the combine (bytes as
    the job's first and second all-to-all of an iteration), the bytes to each peer as the
    job's, summing to the rank's all-to-all bytes; across the ranks the imbalance from the
    job's own per-rank bytes."""
    run = recorded("moe")
    own: dict[int, dict[str, Any]] = {}
    for rank in (0, 1):
        t = run.truth[rank]
        a2a = [c for c in t["calls"] if c["kind"] == "all_to_all" and c["it"] >= 0]
        n_it = len(t["iterations"])
        assert len(a2a) == 2 * n_it
        own[rank] = {"bytes": sum(c["bytes"] for c in a2a) / n_it,
                     "dispatch": sum(c["bytes"] for c in a2a[0::2]) / n_it,
                     "combine": sum(c["bytes"] for c in a2a[1::2]) / n_it,
                     "peers": np.sum([c["peers"] for c in a2a], axis=0) / n_it}
        d = run.rank(rank)
        kinds = d["collectives"]["kinds"]
        assert set(kinds["all_to_all"]["parallelism"]) == {"ep"}
        assert not kinds["all_to_all"]["gradient"]
        assert kinds["all_to_all"]["count"] == pytest.approx(2)
        assert d["units"] and {u["kind"] for u in d["units"]} == {"all_reduce"}
        ep = d["parallelism"]["expert_parallel"]
        assert ep["degree"] == 2 and ep["moe_layers"] == 1
        assert set(ep["roles"]) == {"dispatch", "combine"}
        for role in ("dispatch", "combine"):
            assert ep["roles"][role]["count"] == pytest.approx(1)
            assert ep["roles"][role]["bytes"] == pytest.approx(own[rank][role], rel=BYTES_TOL)
        assert ep["bytes"] == pytest.approx(own[rank]["bytes"], rel=BYTES_TOL)
        assert ep["peers"] == pytest.approx(own[rank]["peers"].tolist(), rel=BYTES_TOL)
        assert sum(ep["peers"]) == pytest.approx(ep["bytes"], rel=BYTES_TOL)
    by = {r: own[r]["bytes"] for r in own}
    ratio = max(by.values()) / float(np.mean(list(by.values())))
    assert ratio > 1.1, by     # the hot expert's rank moves more
    for rank in (0, 1):
        imb = run.rank(rank)["parallelism"]["expert_parallel"]["imbalance"]
        assert imb["ratio"] == pytest.approx(ratio, rel=BYTES_TOL)
        assert imb["most_loaded_rank"] == max(by, key=lambda r: by[r]) == 0
        assert {int(k): v for k, v in imb["bytes_by_rank"].items()} == \
            pytest.approx(by, rel=BYTES_TOL)
    assert "imbalance: the most-loaded rank (0) receives" in run.text
    assert f"; bytes {ratio:.2f}x the mean" in run.text


def test_moe_exposed_comm_is_the_jobs_wait_once(recorded):
    """The exposed comm of the MoE exchange (its gradient comm: the all-reduce it waits on
    in update, rank 1 joining 50 ms late) is the time the job stood in that wait(), to the
    wait's end, which comes after the collective's (the thread wakes after it): the same
    value in the hidden-vs-exposed comm and in the collectives by kind, per rank, and per
    iteration never more than the job's own timing of its wait."""
    run = recorded("moe")
    for rank in (0, 1):
        ra = run.analysis.ranks[rank]
        assert ra.comm["exposed_s"] > 0
        assert ra.collectives.exposed_s == pytest.approx(ra.comm["exposed_s"], rel=1e-9, abs=0)
        assert run.rank(rank)["collectives"]["exposed_s"] == \
            pytest.approx(run.rank(rank)["overlap"]["comm"]["exposed_s"], rel=1e-9, abs=0)
        its = run.truth[rank]["iterations"]
        s = ra.detail.series
        m = per_iteration(run, rank, {"exposed": s.comm_exposed_s}, its)
        waits = run.truth[rank]["waits"]
        job = np.array([sum(w["end"] - w["start"] for w in waits
                            if w["kind"] == "all_reduce" and w["it"] == its[i]["it"]) / 1e9
                        for i in m["job"]])
        assert (m["exposed"] <= job + 1e-6).all(), (rank, m["exposed"].tolist(), job.tolist())
        # the job's clock reads around its wait() and the record's: tens of us apart
        missed = np.median(job - m["exposed"])
        assert missed < 0.5e-3, (rank, m["exposed"].tolist(), job.tolist())


# -- hand-made traces ---------------------------------------------------------------------
def two_ranks(path: Path, colls: list[tuple[str, str, float, float, dict]], n: int = 8) -> Path:
    """2 ranks of n 50 ms iterations (forward 1-15, backward 15-40 ms, update 40-48 ms), each
    with the collectives given: (kind, phase, start ms, end ms, args beside kind, phase,
    a synchronous call and 1 MB)."""
    b = Builder()
    for rank in (0, 1):
        for k in range(n):
            t = k * 50.0
            b.span("iteration", t, t + 50, step=k, rank=rank)
            b.span("forward", t + 1, t + 15, step=k, rank=rank)
            b.span("backward", t + 15, t + 40, step=k, rank=rank)
            b.span("update", t + 40, t + 48, step=k, rank=rank)
            for kind, phase, s, e, args in colls:
                b.span("comm", t + s, t + e, name=kind, step=k, rank=rank, nbytes=1_000_000,
                       args={"kind": kind, "phase": phase, "async": False,
                             "bytes_out": 1_000_000, **args})
    return b.write(str(path), world_size=2)


def mesh(dim: str) -> dict:
    return {"group": {"size": 2, "ranks": [0, 1], "name": "1",
                      "mesh": {"dim": dim, "dims": [dim], "shape": [2]}}}


def desc(dim: str) -> dict:
    return {"group": {"size": 2, "ranks": [0, 1], "name": "1", "desc": f"mesh_{dim}"}}


NAMED = [("tp", "tp"), ("tensor", "tp"), ("pp", "pp"), ("pipe", "pp"), ("ep", "ep"),
         ("expert", "ep"), ("cp", "cp"), ("context", "cp"), ("dp", "dp"),
         ("replicate", "dp"), ("shard", "dp"), ("dp_shard", "dp")]


@pytest.mark.parametrize("group", [mesh, desc], ids=["mesh dimension", "group description"])
@pytest.mark.parametrize(("dim", "want"), NAMED, ids=[n for n, _ in NAMED])
def test_a_collective_serves_the_dimension_its_group_is_named_for(tmp_path, group, dim, want):
    """The same all-reduce in the backward (5 ms, on the job's thread) on a mesh dimension
    (or a group described `mesh_<name>`) named for tensor, pipeline, expert, context or
    data parallelism: that dimension's, its time that dimension's term; only data
    parallelism's a gradient unit."""
    path = two_ranks(tmp_path / "t.arrow", [("all_reduce", "backward", 20, 25, group(dim))])
    d = to_dict(analyze(load(path)))     # analyze --json's document
    ar = d["collectives"]["kinds"]["all_reduce"]
    assert set(ar["parallelism"]) == {want}
    assert ar["gradient"] == (want == "dp")
    assert bool(d["units"]) == (want == "dp")
    if want == "dp":
        assert d["parallelism"] is None and not any(
            f"t_{x}" in d["breakdown"] for x in ("tp", "pp", "ep", "cp"))
    else:
        assert d["parallelism"]["degrees"] == {want: 2}
        assert d["parallelism"]["dimensions"] == f"{want.upper()} 2, 2 ranks"
        assert d["breakdown"][f"t_{want}"]["mean"] == pytest.approx(0.005)
        assert d["breakdown"]["t_comm"]["mean"] == 0
        assert d["speedup"]["points"] == [] and d["what_if"] is None


def test_a_dtensor_redistribution_on_an_unnamed_mesh_is_tensor_parallel(tmp_path):
    """DTensor's all-reduce in the forward on a mesh whose dimensions have no names (and on
    no mesh at all): tensor parallel. The same all-reduce issued by the job itself in the
    forward, on that unnamed mesh, serves no parallelism that can be told: other, and said
    so."""
    dt = {"functional": True, "issuer": "dtensor"}
    path = two_ranks(tmp_path / "t.arrow", [
        ("all_reduce", "forward", 5, 7, {**mesh("dim_0"), **dt}),
        ("all_reduce", "forward", 9, 10, {"group": {"size": 2}, **dt}),
        ("all_gather", "forward", 11, 12, mesh("dim_0"))])
    d = to_dict(analyze(load(path)))
    kinds = d["collectives"]["kinds"]
    assert set(kinds["all_reduce"]["parallelism"]) == {"tp"}
    assert kinds["all_reduce"]["count"] == pytest.approx(2)
    assert set(kinds["all_gather"]["parallelism"]) == {"other"}
    assert d["parallelism"]["degrees"] == {"tp": 2}
    assert d["breakdown"]["t_tp"]["mean"] == pytest.approx(0.003)
    out = _cli("analyze", str(path)).stdout
    assert "TP 2, 2 ranks" in out.splitlines()[0]
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("all_gather"))
    assert "other (not gradient)" in row, out
    assert "single process" not in out


def test_a_collective_whose_parallelism_cannot_be_told_is_other(tmp_path):
    """2 ranks whose only collective, an all-gather in the forward on the default group,
    serves no dimension that can be told: "other", said in the kinds table and the
    headline, which never calls 2 ranks a single process."""
    path = two_ranks(tmp_path / "o.arrow",
                     [("all_gather", "forward", 5, 7, {"group": {"size": 2}})])
    d = to_dict(analyze(load(path)))
    assert set(d["collectives"]["kinds"]["all_gather"]["parallelism"]) == {"other"}
    assert d["parallelism"] is None and d["units"] == []
    out = _cli("analyze", str(path)).stdout
    assert "single process" not in out
    assert out.splitlines()[0].split(". ")[1].startswith(
        "2 ranks, but no gradient communication was recorded"), out.splitlines()[0]
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("all_gather"))
    assert "other (not gradient)" in row, out
