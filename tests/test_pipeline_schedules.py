"""Pipelines with several stages per rank, recorded as users run them: tests/jobs/pp_train.py
under torchrun over gloo on the CPU with torch.distributed.pipelining's Interleaved1F1B and
ZBVZeroBubble (4 stages, 2 per rank, 8 microbatches, 2 ranks) and Interleaved1F1B under
pipeline x data parallel (4 ranks: 2 pipelines of 2 ranks), each held to the job's own
config (its stages, schedule, microbatches, the samples it feeds) and its own clock (each
stage's module forward, each chunk the schedule ran, its waits on its sends and receives,
its step less its passes); warm-up left out, means over the analyzed iterations."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from gputrace.analyzers.parallel.pp import pipesim  # noqa: E402
from tests.test_parallelism import (  # noqa: E402
    PY,
    TIME_TOL,
    WARMUP,
    _cli,
    record_run,
    stages_clocks,
    t_iter_on_the_jobs_clock,
)

pytestmark = pytest.mark.slow
ARGS = ("--iterations", "10", "--width", "512", "--blocks", "2")
CONFIGS = {
    "interleaved": (2, ("--schedule", "interleaved", "--microbatches", "8", *ARGS)),
    "zbv": (2, ("--schedule", "zbv", "--microbatches", "8", *ARGS)),
    "interleaved-dp": (4, ("--schedule", "interleaved", "--microbatches", "4", "--dp", "2",
                           *ARGS)),
    # one model cut unevenly (5 blocks, then 1 and the head): its layers-balanced what-if
    "uneven": (2, ("--schedule", "1f1b", "--microbatches", "4", "--split", "5,1",
                   "--iterations", "10", "--width", "512")),
}
# the configurations with several stages per rank (the stages, the schedule and the waits
# held to the job's); "uneven" is one stage a rank, for the layers-balanced what-if
SEVERAL = ("interleaved", "zbv", "interleaved-dp")
WAIT_FLOOR = 0.008    # s: a wait this short is the job's timing around torch's as much


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("schedules")
    cache = {}

    def get(name: str):
        if name not in cache:
            ranks, args = CONFIGS[name]
            cache[name] = record_run(out / name, "pp_train.py", ranks, args)
        return cache[name]

    return get


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def analyzed(run, rank: int) -> set[int]:
    """The job's iterations (its `it`) that gputrace analyzed on `rank`: each of its kept
    iterations matched to the job's iteration it overlaps most. A per-stage mean is compared
    over these (a mean over other iterations moves with one preempted iteration: 0.5 ms of
    a 2 ms mean for 20 ms in one chunk of 40)."""
    s = run.analysis.ranks[rank].detail.series
    its = run.truth[rank]["iterations"]
    out = set()
    for a, b in zip(s.start_ns[s.kept], s.end_ns[s.kept], strict=True):
        ov = [min(b, t["end"]) - max(a, t["start"]) for t in its]
        out.add(its[int(np.argmax(ov))]["it"])
    return out


def jobs_stage_times(t: dict, its: set[int]) -> dict[int, dict[str, float]]:
    """Per stage the job held, per microbatch: its module's forward and its backward chunks
    (input and weight parts together), as it timed them in the iterations `its`. The
    backward twice: `backward_call`, the torch.autograd.backward call inside a chunk where it
    made one, and `backward`, torch's stage_backward around that call (its own work on the
    outputs and the inputs' gradients: 3-9 % of the chunk on a quiet machine, up to 15 %
    beside the suite's other worker), else, in both, the whole chunk (a zero-bubble
    schedule's split backward)."""
    m = t["stage"]["microbatches"]
    fwd, chunk = defaultdict(list), defaultdict(list)
    bwd, call = defaultdict(float), defaultdict(float)
    its = {c["it"] for c in t["chunks"] if c["it"] in its}
    for f in t["forwards"]:
        if f["it"] in its:
            fwd[f["stage"]].append(f["s"])
    for c in t["chunks"]:
        if c["it"] in its and c["kind"] == "forward":
            chunk[c["stage"]].append(c["s"])
        elif c["it"] in its:
            own, inner = c.get("autograd_s"), c.get("autograd_call_s")
            bwd[c["stage"]] += c["s"] if own is None else own
            call[c["stage"]] += c["s"] if own is None else (inner or own)
    return {k: {"forward": _mean(fwd[k]), "forward_chunk": _mean(chunk[k]),
                "backward": bwd[k] / len(its) / m, "backward_call": call[k] / len(its) / m}
            for k in t["stage"]["indices"]}


@pytest.mark.parametrize("name", SEVERAL)
def test_stages_schedule_and_samples_as_the_job_has_them(recorded, name):
    """The pipeline section: the job's schedule class, microbatches, p x v stages and which
    rank holds which; the theory (p-1)/(v m+p-1); the headline names them; samples per
    iteration as the job feeds a replica (counted once, at the first stage), the job's
    samples/s over its replicas its ranks' own, each rank's iterations within 5 % of the
    job's own, iteration by iteration."""
    run = recorded(name)
    t0 = run.truth[0]["stage"]
    p, v, m = t0["ranks"], len(t0["indices"]), t0["microbatches"]
    pl = run.doc["parallelism"]["pipeline"]
    assert (pl["schedule"], pl["microbatches"], pl["num_stages"], pl["ranks"],
            pl["stages_per_rank"]) == (t0["class"], m, t0["stages"], p, v)
    assert pl["theory"] == pytest.approx((p - 1) / (v * m + p - 1))
    held = {s["rank"]: s["held"] for s in pl["stages"]}
    assert held == {r: t["stage"]["indices"] for r, t in run.truth.items()}
    head = run.text.splitlines()[0]
    short = pipesim.SHORT[t0["class"]]
    assert f"pipeline, {t0['stages']} stages ({v} per rank) x {m} microbatches ({short})" \
        in head, head
    tp = run.doc["throughput"]
    assert tp["samples_per_iteration"] == pytest.approx(t0["samples_per_iteration"])
    assert tp["job"]["replicas"] == t0["replicas"]
    # the job's samples/s is its ranks' own (a replica's samples over each rank's mean
    # iteration, over its pipeline's ranks), and each rank's iterations are the job's own,
    # iteration by iteration on the same iterations (a mean over a few iterations moves
    # with one preempted iteration at the warm-up's edge beside a busy neighbour)
    series = {r: run.analysis.ranks[r].detail.series for r in run.truth}
    rate = [t0["samples_per_iteration"] / float(s.terms["t_iter"][s.kept].mean())
            for s in series.values()]
    assert tp["job"]["samples_per_s"] == pytest.approx(sum(rate) / p, rel=1e-6)
    for r in run.truth:
        t_iter_on_the_jobs_clock(run, r)
    assert pl["what_if"], "no what-ifs"


@pytest.mark.parametrize("name", SEVERAL)
def test_per_stage_compute_and_waits_on_the_jobs_clock(recorded, name):
    """Each stage's forward per microbatch between its module's forward as the job timed it
    inside the module (less 15 %) and the job's forward chunk around it (plus 15 %): gputrace
    times the module's call, hooks included, which lies between the two (a preemption in
    the hooks, beside the suite's other worker, is in gputrace's and the chunk's but not in
    the module's own clock); its backward (both parts) likewise between the job's
    torch.autograd.backward call (less 15 %; gputrace times that call) and torch's
    stage_backward around it (plus 15 %); each rank's waits for
    its neighbours within 15 % (or WAIT_FLOOR) of the job's own waits on its sends and
    receives; t_iter within 5 % of the job's iterations. The job's means are over the
    iterations gputrace analyzed."""
    run = recorded(name)
    pl = run.doc["parallelism"]["pipeline"]
    per = {s["stage"]: s for s in pl["per_stage"]}
    # the pipeline's per-stage times are its replicas' mean: the job's the same
    mine = defaultdict(list)
    for r, t in run.truth.items():
        for k, own in jobs_stage_times(t, analyzed(run, r)).items():
            mine[k].append(own)
    for k, owns in mine.items():
        got, inner, outer = (per[k]["forward_s"], _mean([o["forward"] for o in owns]),
                             _mean([o["forward_chunk"] for o in owns]))
        assert inner * (1 - TIME_TOL) <= got <= outer * (1 + TIME_TOL), \
            (name, k, "forward", inner, got, outer)
        got, inner, outer = (per[k]["backward_s"], _mean([o["backward_call"] for o in owns]),
                             _mean([o["backward"] for o in owns]))
        assert inner * (1 - TIME_TOL) <= got <= outer * (1 + TIME_TOL), \
            (name, k, "backward", inner, got, outer)
    for r, t in run.truth.items():
        t_iter_on_the_jobs_clock(run, r)
        (st,) = [s for s in pl["stages"] if s["rank"] == r]
        its = analyzed(run, r)
        own = _mean([i["waits_s"] for i in t["iterations"] if i["it"] in its])
        assert abs(st["waits_s"] - own) <= max(TIME_TOL * own, WAIT_FLOOR), \
            (name, r, st["waits_s"], own)


def test_bubble_on_the_ranks_clocks(recorded):
    """Per rank of the 2-rank interleaved and ZBV runs: t_pp within 15 % of its step less
    its passes and its loss, as the job timed them."""
    for name in ("interleaved", "zbv"):
        stages_clocks(recorded(name))


def test_diff_gives_the_jobs_samples_per_second_ratio(recorded):
    """`gputrace diff` of the ZBV run against the interleaved one: the job's samples/s
    ratio within 5 % of the ratio of the jobs' own (their batch over their iterations)."""
    a, b = recorded("interleaved"), recorded("zbv")

    def own(run) -> float:
        its = run.truth[0]["iterations"][WARMUP:]
        return 256 / _mean([(i["end"] - i["start"]) / 1e9 for i in its])

    sps = json.loads(_cli("diff", a.arrow, b.arrow, "--json").stdout)["throughput"][
        "samples_per_s"]
    assert sps["before"] == pytest.approx(own(a), rel=0.05)
    assert sps["ratio"] == pytest.approx(own(b) / own(a), rel=0.05), (sps, own(b) / own(a))


def test_calibrate_says_what_it_used_or_why_not(recorded):
    """`--calibrate` with a run of another schedule at the same stages and microbatches
    says it was not used and why; a run of another stage count says why; never silent."""
    a, b = recorded("interleaved"), recorded("zbv")
    doc = json.loads(_cli("analyze", a.arrow, "--calibrate", b.arrow, "--json").stdout)
    c = doc["parallelism"]["pipeline"]["compute"]
    assert "same 8 microbatches" in c["calibration_unused"]
    text = _cli("analyze", a.arrow, "--calibrate", b.arrow).stdout
    assert "--calibrate not used" in text
    p = subprocess.run([PY, "-m", "gputrace", "analyze", a.arrow, "--calibrate",
                        str(Path(a.arrow).with_suffix(".missing"))], capture_output=True,
                       text=True)
    assert p.returncode == 2


def test_each_schedule_what_if_carries_its_kinds_measured_error(recorded):
    """At the recorded microbatch count, each schedule what-if is given with the error its
    kind was measured off by (whatif_bands, beyond 10 %): between a fused backward
    (Interleaved1F1B, GPipe, 1F1B) and one split into its input and weight parts (ZBV) the
    widest (torch's split backward costs more than the fused one, which the replay does not
    predict: pp_split); between stage counts per rank, pp_stages; between schedules alike in
    both, pp_schedule; and the terminal says what each band is."""
    from gputrace.analyzers.parallel import whatif_bands as wb
    from gputrace.analyzers.parallel.pp import pporders

    for name in ("interleaved", "zbv"):
        pl = recorded(name).doc["parallelism"]["pipeline"]
        same_m = [w for w in pl["what_if"] if w["microbatches"] == pl["microbatches"]]
        assert {w["schedule"] for w in same_m} >= {"ScheduleGPipe", "Schedule1F1B"}, same_m
        kinds = set()
        for w in same_m:
            if (w["schedule"] in pporders.SPLIT) != (pl["schedule"] in pporders.SPLIT):
                kind = "pp_split"
            elif w["stages_per_rank"] != pl["stages_per_rank"]:
                kind = "pp_stages"
            else:
                kind = "pp_schedule" if w["schedule"] != pl["schedule"] else None
            want = wb.band(kind)
            assert (tuple(w["band"]) if w["band"] else None) == want, (pl["schedule"], w)
            kinds.add(kind)
        assert "pp_split" in kinds, (name, same_m)
        # the terminal says what each band shown is
        text = recorded(name).text
        for kind, words in (("pp_split", "split into its input and weight parts"),
                            ("pp_stages", "between stage counts per rank"),
                            ("pp_schedule", "between schedules at the same stages per rank")):
            assert (words in text) == (kind in kinds and wb.band(kind) is not None), \
                (name, kind, text[-3000:])


def test_layers_balanced_what_if_of_an_uneven_cut(recorded):
    """A pipeline cut unevenly (the job's `--split 5,1`): its "layers balanced across
    stages" what-if moves a block to the lighter stage and predicts a shorter iteration than
    the run's own, given with the error such what-ifs were measured off by against the run
    of the model cut so (whatif_bands' pp_layers, bench/whatif_pp_balance.py); the terminal
    says what that band is."""
    from gputrace.analyzers.parallel import whatif_bands as wb

    run = recorded("uneven")
    pl = run.doc["parallelism"]["pipeline"]
    assert (pl["schedule"], pl["microbatches"], pl["num_stages"]) == ("Schedule1F1B", 4, 2)
    (w,) = [w for w in pl["what_if"] if w["what"].startswith("layers balanced across stages")]
    # the cut it replays, beside the job's: 5 blocks and 1 block with the head
    assert w["what"].endswith("layers (now 5 + 2)"), w
    assert w["schedule"] == pl["schedule"] and w["microbatches"] == pl["microbatches"]
    own = float(np.mean([s["t_iter"] for s in pl["stages"]]))
    assert w["t_iter"] < own, (w, own)
    assert tuple(w["band"]) == wb.band("pp_layers"), w
    assert "the layers balanced across stages, how far such a what-if was" in run.text


def test_a_balanced_cut_counts_what_each_stage_carries_besides_its_layers():
    """The cut that balances the layers counts each stage's own work (the last stage's loss,
    the schedule's work around its chunks), which stays with the stage: four equal layers
    over two stages cut 2 + 2 alone, 3 + 1 when the second stage carries two layers' worth
    of its own (a cut by the layers alone predicted a 3 + 1 job, at width 512, slower when
    "balanced": 24.9 against 22.3 ms)."""
    assert pipesim.balance([1.0] * 4, 2) == [2]
    assert pipesim.balance([1.0] * 4, 2, [0.0, 2.0]) == [3]
    assert pipesim.balance([1.0] * 4, 2, [2.0, 0.0]) == [1]
