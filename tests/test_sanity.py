"""Analyses that are never absurd, on hand-built traces shaped like the runs that showed
absurd ones: a 2-rank DeepSpeed-like run (gradient all-reduces after backward, an overflow
check and a gradient norm of a few bytes in the step), a torch.compile'd DDP job whose
gradient comm was not recorded, a one-process run over a slow link."""

from __future__ import annotations

import json

import pytest

from gputrace.analyzers import analyze
from gputrace.trace import load
from tests.conftest import run_gputrace
from tests.tracebuilder import Builder, ddp_iterations

LAYERS = ((4, 10, 14), (3, 14, 18), (2, 18, 22), (1, 22, 25))   # backward ends at 25 ms


def deepspeed_like(path, grads=((27.5, 30.0, 4e6), (30.5, 33.0, 4e6)), grad_kind="all_reduce",
                   layer_bytes=2_000_000, n=8):
    """2 ranks, 37 ms iterations: backward per layer 10-25 ms, the gradients' collectives
    (start, end, bytes) after it on the job's thread, then the step 33-37 ms with an 8-byte
    overflow check and a 4-byte gradient norm all-reduced in it."""
    b = Builder()
    for rank in (0, 1):
        for k in range(n):
            t = k * 37.0
            b.span("iteration", t, t + 37, step=k, rank=rank)
            b.span("io", t, t + 1, step=k, rank=rank)
            b.span("forward", t + 1, t + 10, step=k, rank=rank)
            for ly, s, e in LAYERS:
                b.span("backward", t + s, t + e, layer=ly, step=k, rank=rank,
                       nbytes=layer_bytes)
            for s, e, nb in grads:
                b.span("comm", t + s, t + e, name=grad_kind, step=k, rank=rank, nbytes=nb,
                       args={"kind": grad_kind, "phase": "backward", "async": False,
                             "group": {"size": 2}})
            b.span("update", t + 33, t + 37, step=k, rank=rank)
            for s, e, nb in ((33.2, 33.5, 8), (33.6, 33.8, 4)):
                b.span("comm", t + s, t + e, name="all_reduce", step=k, rank=rank, nbytes=nb,
                       args={"kind": "all_reduce", "phase": "update", "async": False,
                             "group": {"size": 2}})
    return b.write(str(path), world_size=2)


def analyze_json(path, *args):
    return json.loads(run_gputrace("analyze", str(path), "--json", *args, check=True).stdout)


def test_a_collective_of_a_few_bytes_is_never_a_gradient_unit(tmp_path):
    path = deepspeed_like(tmp_path / "ds.arrow")
    d = analyze_json(path)
    # the gradient units are the two 4 MB all-reduces; the overflow check and the norm are not
    assert [u["bytes"] for u in d["units"]] == [4e6, 4e6]
    ar = d["collectives"]["kinds"]["all_reduce"]
    assert ar["count"] == pytest.approx(4) and ar["gradient"]
    assert ar["small"]["count"] == pytest.approx(2) and ar["small"]["bytes"] == pytest.approx(12)
    assert d["collectives"]["small_below_bytes"] == 1024
    # their time is still comm time: 2.5 + 2.5 ms of gradients and 0.3 + 0.2 ms of them
    assert d["breakdown"]["t_comm"]["mean"] == pytest.approx(0.0055)
    # nor is the cost fitted on them: the replay's units are the gradients'
    assert d["what_if"] is not None and d["what_if"]["comm_cost"]["source"] == "measured"
    out = run_gputrace("analyze", str(path), check=True).stdout
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("all_reduce")
               and "0.00" in ln)
    assert "other (under 1 KiB each, not gradient" in row, out
    assert "of a few bytes (12 B" in out
    # a toy model whose whole gradient is a few hundred bytes keeps its units
    toy = deepspeed_like(tmp_path / "toy.arrow", grads=((27.5, 30.0, 200), (30.5, 33.0, 200)),
                         layer_bytes=100)
    assert [u.nbytes for u in analyze(load(toy)).main.model.units] == [200, 200, 8, 4]


def test_an_all_reduce_efficiency_over_100_percent_is_never_printed(tmp_path):
    path = deepspeed_like(tmp_path / "ds.arrow")
    # 8 MB all-reduced by 2 ranks in 5.5 ms of comm needs 1.45 GB/s of bus bandwidth
    d = analyze_json(path, "--link-bandwidth", "0.5GB/s")
    sp = d["speedup"]
    assert sp["allreduce_efficiency"] is None
    why = sp["allreduce_efficiency_withheld"]
    assert "faster than the stated link allows" in why and "are wrong" in why
    out = run_gputrace("analyze", str(path), "--link-bandwidth", "0.5GB/s", check=True).stdout
    (line,) = [ln for ln in out.splitlines() if "all-reduce efficiency" in ln]
    assert "not shown" in line and "1.45 GB/s" in line, line
    # eq. 12 counts the bytes of both ranks: at 2 GB/s it gives 145 %, while a ring
    # all-reduce of 8 MB per rank in 5.5 ms is 73 % of the link
    sp2 = analyze(load(path), link_bytes_per_s=2e9).main.speedup
    assert sp2.allreduce_efficiency is None
    assert "145%" in sp2.allreduce_efficiency_withheld
    assert "ran at 73% of the link's 2.00 GB/s" in sp2.allreduce_efficiency_withheld
    # within 100 % it is given as before
    sp3 = analyze(load(path), link_bytes_per_s=4e9).main.speedup
    assert sp3.allreduce_efficiency == pytest.approx(2 * 8e6 / (0.0055 * 4e9))
    assert sp3.allreduce_efficiency_withheld is None


def _sync_in_backward(path):
    """Gradient all-reduces issued inside the backward on the job's own thread, which
    stands in each (no per-layer spans): no compute runs beside them."""
    b = Builder()
    for rank in (0, 1):
        for k in range(6):
            t = k * 40.0
            b.span("iteration", t, t + 40, step=k, rank=rank)
            b.span("forward", t + 1, t + 10, step=k, rank=rank)
            b.span("backward", t + 10, t + 34, step=k, rank=rank)
            for s, e in ((20, 23), (24, 27), (28, 33)):
                b.span("comm", t + s, t + e, name="all_reduce", step=k, rank=rank,
                       nbytes=2e6, args={"kind": "all_reduce", "phase": "backward",
                                         "async": False})
            b.span("update", t + 34, t + 39, step=k, rank=rank)
    return b.write(str(path), world_size=2)


def test_a_unit_is_hidden_only_as_the_overlap_counts_it(tmp_path):
    # unit 0 starts 2.5 ms after the backward ended and ends before unit 1 starts
    d = analyze_json(deepspeed_like(tmp_path / "ds.arrow"))
    assert d["overlap"]["comm"]["hidden_s"] == 0
    after = [u for u in d["units"] if u["start_s"] > 0.025]    # the backward ended at 25 ms
    assert after and not any(u["hidden"] for u in after), after
    assert [u["hidden"] for u in d["units"]] == [False, False]
    # inside the backward, but the job's thread stood in them: nothing hid them either
    s = analyze(load(_sync_in_backward(tmp_path / "sync.arrow"))).main
    assert s.comm["hidden_s"] == 0
    assert [u.hidden for u in s.model.units] == [False, False, False]
    assert s.model.case == 2
    out = run_gputrace("analyze", str(tmp_path / "sync.arrow"), check=True).stdout
    assert "units 0-1 run outside compute" in out.splitlines()[0]
    assert "Case 1" not in out
    # DDP's buckets hidden under backward stay hidden
    case1 = ddp_iterations(Builder(), [([4], 40, 50), ([3], 55, 65), ([2], 70, 80),
                                       ([1], 85, 90)]).write(str(tmp_path / "c1.arrow"))
    assert [u.hidden for u in analyze(load(case1)).main.model.units] == [True] * 3 + [False]


def test_predictions_from_a_few_bytes_of_comm_are_withheld_with_the_reason(tmp_path):
    """200 kB of gradients all-reduced per iteration, while the layers' gradients hold 8 MB:
    a cost per byte fitted on that comm would turn a bucket of the model into far more than
    the run ever took."""
    path = deepspeed_like(tmp_path / "ds.arrow", grads=((27.5, 31.0, 200_000),))
    d = analyze_json(path)
    assert d["what_if"] is None
    assert [u["bytes"] for u in d["units"]] == [200_000]
    why = d["what_if_unavailable"]
    assert "200,000 bytes per iteration" in why and "under the 1.0 MB" in why
    out = run_gputrace("analyze", str(path), check=True).stdout
    said = [ln for ln in out.splitlines() if ln.startswith("What if")]
    assert len(said) == 1 and "not replayed: the measured gradient comm moves" in said[0]


def test_a_prediction_over_3x_the_measured_iteration_is_withheld(tmp_path):
    """One process, 50 MB of gradients, a 0.3 GB/s link: 4 GPUs or more would wait longer
    for comm than the whole measured iteration takes, three times over."""
    b = Builder()
    for k in range(6):
        t = k * 100.0
        b.span("iteration", t, t + 100, step=k)
        b.span("forward", t + 5, t + 40, step=k)
        b.span("backward", t + 40, t + 90, step=k, layer=1, nbytes=50_000_000)
        b.span("update", t + 90, t + 99, step=k)
    path = b.write(str(tmp_path / "one.arrow"))
    d = analyze_json(path, "--link-bandwidth", "0.3GB/s")
    pts = {p["gpus"]: p for p in d["speedup"]["points"]}
    # 2 GPUs: 100 ms + 50 MB / 0.3 GB/s = 267 ms, shown
    assert pts[2]["t_iter"] == pytest.approx(0.1 + 50e6 / 3e8, rel=0.02)
    assert pts[2]["withheld"] is None
    for n in (4, 8, 16):
        assert pts[n]["t_iter"] is None and pts[n]["speedup"] is None
        assert "over 3x the measured 100.0 ms" in pts[n]["withheld"]
    measured = d["breakdown"]["t_iter"]["mean"]
    sc = d["what_if"]["scenarios"]
    assert any(s["withheld"] for s in sc)
    assert all(s["t_iter"] is None if s["withheld"] else s["t_iter"] <= 3 * measured
               for s in sc)
    out = run_gputrace("analyze", str(path), "--link-bandwidth", "0.3GB/s", check=True).stdout
    assert "withheld: 4 GPUs (and 2 more like it): " in out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()[:2] in ("4 ", "8 ", "16")}
    assert all("withheld" in rows[n] for n in ("4", "8", "16")), rows


def compiled_ddp(path, barrier_at=(405.0, 406.0), barrier_each_iteration=False):
    """2 ranks of a torch.compile(DDP(model)) loop whose gradient comm was not recorded, with
    one barrier recorded at `barrier_at` (ms)."""
    b = Builder()
    for rank in (0, 1):
        for k in range(8):
            t = k * 50.0
            b.span("iteration", t, t + 50, step=k, rank=rank)
            b.span("forward", t + 1, t + 15, step=k, rank=rank)
            b.span("backward", t + 15, t + 40, step=k, rank=rank)
            b.span("update", t + 40, t + 48, step=k, rank=rank)
            if barrier_each_iteration:
                b.span("comm", t + 48, t + 49, name="barrier", step=k, rank=rank,
                       args={"kind": "barrier", "phase": "none"})
        if barrier_at is not None:
            b.span("comm", *barrier_at, name="barrier", rank=rank,
                   args={"kind": "barrier", "phase": "none"})
    return b.write(str(path), world_size=2)


@pytest.mark.parametrize("where", [(405.0, 406.0), (10.0, 11.0), (-5.0, -4.0)],
                         ids=["after the last", "in warm-up", "before the first"])
def test_no_collective_in_the_analyzed_iterations_is_said_whatever_was_recorded_outside(
        tmp_path, where):
    path = compiled_ddp(tmp_path / "c.arrow", where)
    r = analyze(load(path)).main
    assert r.collectives.recorded == 1 and r.collectives.in_iterations == 0
    assert r.comm_missing and "no collective was recorded" in r.comm_missing
    assert r.speedup.points == [] and r.replay is None
    out = run_gputrace("analyze", str(path), check=True).stdout
    assert "2 ranks, but no collective was recorded in the analyzed iterations" in \
        out.splitlines()[0]
    assert "Predicted speedup: not computed" in out and "100%" not in out


def test_what_the_recording_noted_is_said_with_the_missing_comm(tmp_path):
    """A process's torch collector says why it could not see the gradient comm (compiled
    autograd's DDP): the headline's reason carries it."""
    note = "DDP under compiled autograd (python reducer): its all-reduces are not seen"
    b = Builder()
    for k in range(8):
        b.span("iteration", k * 50.0, k * 50.0 + 50, step=k, rank=0)
        b.span("backward", k * 50.0 + 15, k * 50.0 + 40, step=k, rank=0)
    shard = {"role": "process", "rank": 0, "torch": {"notes": [note]}}
    path = b.write(str(tmp_path / "n.arrow"), world_size=2, shards=[shard, shard])
    r = analyze(load(path)).main
    assert r.comm_missing.endswith(f"(the recording noted: {note})"), r.comm_missing


def test_collectives_none_of_them_gradient_give_no_speedup(tmp_path):
    """A barrier every iteration, or only a few bytes' all-reduces beside reduce-scatters
    the data-parallel model does not read: no comm to scale, so no perfect scaling either."""
    r = analyze(load(compiled_ddp(tmp_path / "b.arrow", None, True))).main
    assert r.comm_missing and "no gradient communication" in r.comm_missing
    assert r.speedup.points == [] and r.replay is None
    z = analyze(load(deepspeed_like(tmp_path / "z.arrow", grads=((27.5, 33.0, 8e6),),
                                    grad_kind="reduce_scatter"))).main
    assert z.model.units == [] and "no gradient communication" in z.comm_missing
    assert z.speedup.points == [] and z.replay is None
    assert "a few bytes" in z.comm_missing


def test_comm_after_backward_is_not_called_case_1(tmp_path):
    units = [([4, 3], 85, 88), ([2, 1], 88, 91)]
    path = ddp_iterations(Builder(), units, update=(91, 98)).write(str(tmp_path / "s.arrow"))
    r = analyze(load(path), skip=1).main
    assert r.model.strategy == "sequential"
    ids = {f.id: f.message for f in r.findings}
    assert "comm_tail" not in ids and not any("Case 1" in m for m in ids.values())
    assert "runs after the backward pass" in ids["comm_not_overlapped"]
