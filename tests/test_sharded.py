"""Sharded data parallel and every collective, analyzed: real 2-rank FSDP jobs over gloo
that count their own collectives and time their own phases (tests/jobs/fsdp_train.py), a
trace of one of them with its comm rows removed, and hand-built traces with known answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from gputrace.analyzers import analyze
from gputrace.analyzers import shardsim as sim
from gputrace.trace import load, write_trace
from tests.conftest import run_gputrace
from tests.tracebuilder import Builder, ddp_iterations

JOB = str(Path(__file__).parent / "jobs" / "fsdp_train.py")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """One recording per mode, with the job's own truth files."""
    d = tmp_path_factory.mktemp("fsdp")
    done: dict[str, tuple[Path, str]] = {}

    def get(mode: str) -> tuple[Path, str]:
        if mode not in done:
            out = d / f"{mode}.arrow"
            p = run_gputrace("record", "-f", "-o", str(out), "--", sys.executable, "-m",
                             "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             JOB, str(d / mode), "--mode", mode, "--iterations", "9",
                             "--blocks", "3", timeout=600)
            assert p.returncode == 0, p.stderr[-3000:]
            done[mode] = (out, str(d / mode))
        return done[mode]

    return get


def _truth(prefix: str, rank: int, skip: int) -> tuple[dict, list[dict]]:
    t = json.load(open(f"{prefix}.rank{rank}.json"))
    its = t["iterations"][skip:]
    sel = {i["it"] for i in its}
    kinds: dict[str, list[float]] = {}
    for c in t["calls"]:
        if c["it"] in sel:
            k = kinds.setdefault(c["kind"], [0.0, 0.0])
            k[0] += 1 / len(its)
            k[1] += c["bytes"] / len(its)
    return kinds, its


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp2", "fsdp2-keep", "fsdp1"])
def test_fsdp_collectives_and_phases_match_the_jobs_own_count(fsdp, mode):
    path, prefix = fsdp(mode)
    d = json.loads(run_gputrace("analyze", str(path), "--json", check=True).stdout)
    for r, ra in d["ranks"].items():
        kinds, its = _truth(prefix, int(r), ra["iterations"]["warmup_skipped"])
        got = ra["collectives"]["kinds"]
        assert set(got) == set(kinds), (got, kinds)
        for k, (count, nbytes) in kinds.items():
            assert got[k]["count"] == pytest.approx(count, abs=0.01), k
            assert got[k]["bytes"] == pytest.approx(nbytes, rel=0.01), k
        sh = ra["sharded"]
        assert sh["strategy"] == ("fsdp1" if mode == "fsdp1" else "fsdp2")
        assert (sh["per_iteration"]["reshard_gather"] > 0) == (mode != "fsdp2-keep")
        assert {u["kind"] for u in ra["units"]} <= {"all_gather", "reduce_scatter"}
        t_iter = np.mean([(i["end"] - i["start"]) / 1e9 for i in its])
        assert ra["breakdown"]["t_iter"]["mean"] == pytest.approx(t_iter, rel=0.05)
        for term, ph in (("t_f", "forward"), ("t_b", "backward"), ("t_u", "update")):
            own = np.mean([i[ph] for i in its])
            # 15 % of the term, or 1 % of the iteration for a term of a millisecond
            assert abs(ra["breakdown"][term]["mean"] - own) <= max(0.15 * own,
                                                                     0.01 * t_iter), term
    p = run_gputrace("analyze", str(path), check=True)
    head = p.stdout.splitlines()[0]
    ag = round(d["sharded"]["kinds"]["all_gather"])
    rs = round(d["sharded"]["kinds"]["reduce_scatter"])
    assert f"2 ranks: {ag} all-gathers and {rs} reduce-scatters per iteration" in head, head
    assert "comm is free" not in p.stdout


@pytest.mark.slow
def test_fsdp_what_ifs_carry_interval_and_assumptions(fsdp):
    path, _ = fsdp("fsdp2")
    d = json.loads(run_gputrace("analyze", str(path), "--json", check=True).stdout)
    sh = d["sharded"]
    labels = {w["label"]: w for w in sh["what_if"]}
    assert "reshard_after_forward=False" in labels and "link x2" in labels
    w = labels["reshard_after_forward=False"]
    assert w["t_iter_low"] <= w["t_iter"] <= w["t_iter_high"]
    # no re-gathers cannot be slower than re-gathering; a faster link no slower
    assert w["t_iter"] <= d["breakdown"]["t_iter"]["mean"] * 1.001
    assert labels["link x2"]["t_iter"] <= labels["link x0.5"]["t_iter"]
    assert sh["assumptions"] and d["speedup"]["points"]
    assert abs(sh["baseline_error"]) < 0.25, sh["baseline_error"]


@pytest.mark.slow
def test_real_two_rank_trace_without_its_comm_rows_says_so(fsdp, tmp_path):
    """A trace built from the real FSDP recording with every comm row removed: two ranks
    whose collectives were not captured."""
    path, _ = fsdp("fsdp2")
    tr = load(str(path))
    t = tr.table
    keep = pa.compute.not_equal(t.column("cat").cast(pa.string()), "comm")
    out = tmp_path / "nocomm.arrow"
    write_trace(str(out), tr.metadata, table=t.filter(keep))
    p = run_gputrace("analyze", str(out), check=True)
    assert "2 ranks, but no collective was recorded" in p.stdout.splitlines()[0]
    assert "comm is free" not in p.stdout and "Predicted speedup: not computed" in p.stdout
    d = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    assert d["comm_missing"] and d["speedup"]["points"] == []
    assert "comm_missing" in {f["id"] for f in d["findings"]}


def test_one_process_predicts_only_from_bytes_and_a_known_link(tmp_path):
    b = Builder()
    for k in range(6):
        t = k * 100.0
        b.span("iteration", t, t + 100, step=k)
        b.span("forward", t + 5, t + 40, step=k)
        b.span("backward", t + 40, t + 90, step=k, layer=1, nbytes=50_000_000)
        b.span("update", t + 90, t + 99, step=k)
    path = b.write(str(tmp_path / "one.arrow"))
    a = analyze(load(path))
    sp = a.main.speedup
    assert not sp.points and "link bandwidth" in sp.unavailable
    assert not any("free" in x for x in sp.assumptions)
    sp = analyze(load(path), link_bytes_per_s=1e9).main.speedup
    # 2(N-1)/N x 50 MB at 1 GB/s after 90 ms of compute
    p2 = next(p for p in sp.points if p.gpus == 2)
    assert p2.t_iter == pytest.approx(0.1 + 0.05, rel=0.02)


def test_ddp_analysis_ignores_a_buffer_broadcast_and_a_barrier(tmp_path):
    units = [((4, 3), 55, 62), ((2, 1), 85, 89)]
    plain = ddp_iterations(Builder(), units).write(str(tmp_path / "a.arrow"))
    b = ddp_iterations(Builder(), units)
    for k in range(6):
        t = k * 100.0
        b.span("comm", t + 6, t + 8, name="broadcast", step=k, args={
            "kind": "broadcast", "phase": "forward", "group": {"size": 2}}, nbytes=4096)
        b.span("comm", t + 99, t + 99.5, name="barrier", step=k, args={
            "kind": "barrier", "phase": "none"})
    more = b.write(str(tmp_path / "b.arrow"))
    x, y = analyze(load(plain)).main, analyze(load(more)).main
    assert x.model == y.model and x.comm == y.comm
    assert x.breakdown["t_comm"] == y.breakdown["t_comm"]
    kinds = {k.kind: k for k in y.collectives.kinds}
    assert kinds["broadcast"].count == 1 and not kinds["broadcast"].gradient
    assert kinds["barrier"].count == 1 and kinds["all_reduce"].gradient


def test_replay_prefetch_hides_an_all_gather_under_the_previous_units_compute():
    side = sim.Side(0.0, [10.0, 10.0, 10.0], [4.0, 4.0, 4.0], [], [1, 2, 3])
    tl = sim.Timeline(side, sim.Side(0.0, [1.0], [None], [None], [-1]), 42.0, 1.0, 43.0)
    none = sim.simulate(tl, sim.Knobs(0, 0))
    one = sim.simulate(tl, sim.Knobs(1, 0))
    assert none.exposed_forward_s == pytest.approx(12.0)      # every gather waited for
    assert one.exposed_forward_s == pytest.approx(4.0)        # only the first
    assert sim.predict(tl, sim.Knobs(1, 0), sim.Knobs(0, 0)) == pytest.approx(43.0 - 8.0)


def test_imported_nccl_kernels_are_comm_of_their_kind(shared_data):
    """A PyTorch profiler trace of a real NCCL job: every ncclKernel_* is one collective of
    the kind its name says (counted in the file itself)."""
    import gzip
    import re

    path = shared_data / "kineto" / "nccl_data.json.gz"
    names = re.findall(r'"name": *"ncclKernel_([A-Za-z]+)_', gzip.open(path, "rt").read())
    want = {{"AllReduce": "all_reduce", "Broadcast": "broadcast"}[n] for n in names}
    d = json.loads(run_gputrace("analyze", str(path), "--json", check=True).stdout)
    c = d["collectives"]
    assert c["recorded"] == len(names)
    assert set(c["kinds"]) == want
    assert {u["kind"] for u in d["units"]} <= want and d["comm_missing"] is None
