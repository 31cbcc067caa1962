"""`record --pp-probe`: each pipeline stage timed by the job itself at half and twice its
microbatch's rows after the last iteration, and the microbatch what-ifs taken from it.

In one process: the probe leaves the stage's module as the job had it (its gradients, its
batch-norm statistics, its random generators, its mode) and refuses a module that would
communicate; the analysis says why a probe it cannot use is not used. Then a real
recording (tests/jobs/pp_train.py, GPipe on 2 ranks over gloo, 4 microbatches, then 8, then
4 again in one process): the probe's figures in the trace, nothing of it among the job's
spans, and the what-if at 8 microbatches against the job's own iterations at 8."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gputrace.analyzers.parallel.pp import pp_probed  # noqa: E402
from gputrace.collectors.torch import pp_probe  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.lin(x)))


class _Stage:
    """What the probe reads of a PipelineStage: its index and module."""

    def __init__(self, mod: torch.nn.Module, index: int = 1) -> None:
        self.submod, self.stage_index = mod, index


def test_the_probe_leaves_the_stage_as_the_job_had_it():
    """Timed at 4, 8 and 16 rows (the kept microbatch of 8 cut and doubled), and after it
    the module's gradients, batch-norm statistics, random generator and mode are the job's:
    the probe accumulated into gradients of its own and ran in the mode of the step."""
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(8, 16, requires_grad=True)
    net(x).sum().backward()              # the job's own step left gradients
    grads = [p.grad.clone() for p in net.parameters()]
    stats = [b.clone() for b in net.buffers()]
    net.eval()                           # the job evaluated after its last step
    rng = torch.get_rng_state()
    kept = pp_probe._Kept(_Stage(net), (x.detach().clone().requires_grad_(),), {}, 8,
                          True, 4)
    out = pp_probe._time_stage(kept)
    assert out["rows"] == [4, 8, 16] and "failed" not in out, out
    assert all(t > 0 for t in out["forward_s"] + out["backward_s"])
    # the backward split as the zero-bubble schedules split it, in the same rounds
    assert out["input_s"] > 0 and out["weight_s"] > 0 and "split_skipped" not in out, out
    assert len(out["input_rounds_s"]) == len(out["weight_rounds_s"]) == pp_probe.ROUNDS
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads, strict=True))
    assert all(torch.equal(b, s) for b, s in zip(net.buffers(), stats, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert not net.training


def test_a_stage_of_token_ids_is_probed_fused_and_says_why_not_split():
    """An embedding's inputs (integers) take no gradient: its split backward is not timed,
    and the probe says why; the fused figures stand."""
    emb = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16))
    ids = torch.randint(0, 50, (8, 4))
    out = pp_probe._time_stage(pp_probe._Kept(_Stage(emb, 0), (ids,), {}, 8, True, 4))
    assert "failed" not in out and all(t > 0 for t in out["backward_s"]), out
    assert "input_s" not in out and "takes a gradient" in out["split_skipped"], out


@pytest.mark.gpu
def test_the_probe_times_a_cuda_stage_with_its_device_synchronized():
    """On a GPU: a stage of 4 Linear(8192) layers timed at 128, 256 and 512 rows, each
    figure the device's work (synchronized around it: the forward at 512 rows at least
    0.8 of what CUDA events time it at, where its launches alone take a few tens of
    microseconds); the stage's gradients and the device's random generator as the job had
    them; its backward split as the zero-bubble schedules split it timed too."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(4)]).cuda()
    x = torch.randn(256, 8192, device="cuda")
    net(x).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    rng = torch.cuda.get_rng_state()
    out = pp_probe._time_stage(pp_probe._Kept(_Stage(net), (x,), {}, 256, True, 4))
    assert out["rows"] == [128, 256, 512] and "failed" not in out, out
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads, strict=True))
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    # the split backward on the device: both parts timed, together about the fused one
    # (the same GEMMs: a Linear's input and weight gradients take as many FLOPs)
    split = out["input_s"] + out["weight_s"]
    assert 0.5 * out["backward_s"][1] <= split <= 3 * out["backward_s"][1], out
    big = torch.randn(512, 8192, device="cuda")
    events = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        net(big)
        b.record()
        torch.cuda.synchronize()
        events.append(a.elapsed_time(b) / 1e3)
    assert out["forward_s"][2] >= 0.8 * min(events), (out, events)


def test_the_probe_refuses_a_stage_that_communicates(tmp_path):
    """A stage under DistributedDataParallel (its backward all-reduces) is not probed: the
    ranks would wait for one another at exit. Its reason is what the trace keeps."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        assert "DistributedDataParallel" in pp_probe._unprobable(torch.nn.Sequential(ddp))
        assert pp_probe._unprobable(torch.nn.Linear(4, 4)) == ""
    finally:
        dist.destroy_process_group()


def test_a_probe_the_analysis_cannot_use_says_why():
    """At another microbatch count than the analyzed, or without every stage: no points,
    and the reason in words; with every stage, the measured times scaled by the probe's
    ratios at each size, the microbatch counts those rows make."""
    pr = pp_probed.Probe(4, 64, 5, {0: ((32, 64, 128), (1.0, 2.0, 4.0), (2.0, 3.0, 6.0)),
                                    1: ((32, 64, 128), (1.0, 1.0, 3.0), (1.0, 2.0, 2.0))})
    pts, why = pp_probed.points(pr, 4, [0.010, 0.020], [0.030, 0.040], 0.002)
    assert why == "" and [p[0] for p in pts] == [2.0, 4.0, 8.0]
    two, four, eight = pts
    assert four[1:] == ((0.010, 0.020), (0.030, 0.040), 0.002)
    assert eight[1] == pytest.approx((0.005, 0.020)) and eight[2] == pytest.approx(
        (0.020, 0.020))
    assert two[1] == pytest.approx((0.020, 0.060)) and two[3] == pytest.approx(0.006)
    assert "the analyzed iterations ran 8" in pp_probed.points(pr, 8, [1, 1], [1, 1], 0)[1]
    assert "stage 2 not probed" in pp_probed.points(pr, 4, [1, 1, 1], [1, 1, 1], 0)[1]
    md = {"shards": [{"pipeline": {"probe_skipped": "the stage holds a FSDPLinear (its "
                                   "forward or backward communicates)"}}]}
    asked = pp_probed.of_metadata({"pp_probe": True,
                                   "shards": [{"pipeline": {"schedule": "TrainSchedule"}}]})
    assert asked is not None and "DeepSpeed" in pp_probed.points(asked, 4, [1], [1], 0)[1]
    assert pp_probed.of_metadata({"shards": [{"pipeline": {"schedule": "x"}}]}) is None
    skipped = pp_probed.of_metadata(md)
    assert skipped is not None and "FSDPLinear" in pp_probed.points(skipped, 4, [1], [1],
                                                                      0)[1]


# -- a real recording ---------------------------------------------------------------------
BLOCK, SETTLE = 7, 2


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """GPipe at 4 microbatches, then 8, then 4 again in one recording with --pp-probe, the
    first block in full detail after SETTLE iterations; per block the job's own iterations
    on stage 0's rank less each block's first SETTLE."""
    from tests.test_parallelism import JOBS, PY, _cli

    prefix = tmp_path_factory.mktemp("pp-probe") / "gpipe"
    arrow = f"{prefix}.arrow"
    _cli("record", "-q", "-o", arrow, "--pp-probe", "--steps",
         f"{SETTLE}:{BLOCK - SETTLE}", "--", PY, "-m", "torch.distributed.run",
         "--standalone", "--nproc_per_node", "2", str(JOBS / "pp_train.py"), str(prefix),
         "--schedule", "gpipe", "--microbatches", "4", "--then", "8,4", "--iterations",
         str(BLOCK))
    truth = {r: json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in (0, 1)}
    its = truth[0]["iterations"]
    assert [i["microbatches"] for i in its] == [4] * BLOCK + [8] * BLOCK + [4] * BLOCK
    blocks = [[(i["end"] - i["start"]) / 1e9 for i in its[k * BLOCK + SETTLE:(k + 1) * BLOCK]]
              for k in range(3)]
    return arrow, truth, blocks


@pytest.mark.slow
@pytest.mark.serial
def test_a_probed_recording_gives_the_microbatch_what_if_from_the_jobs_own_sizes(probed):
    """The probe's figures per stage at 32, 64 and 128 rows (the job's 256 samples as 4
    microbatches of 64), timed after the job's last iteration on each rank and leaving no
    span of its own (every forward and backward span inside the job's iterations); the
    what-ifs' compute `probed`, said in the assumptions, the band its kind's; the probe's
    time inside each rank's run, given apart in its shut-down; the what-if
    at 8 microbatches within that band, widened by how far the machine's speed moved inside
    the recording (the third block against the first, the job's clock), of the job's own
    iterations at 8. A `--calibrate` run it cannot use (the same count) leaves the probe's
    model, and the report page says so as the terminal does."""
    from gputrace import load
    from gputrace.analyzers.parallel.pp import pp_whatif
    from tests.test_parallelism import _cli

    arrow, truth, blocks = probed
    trace = load(arrow)
    pr = pp_probed.of_metadata(trace.metadata)
    assert pr is not None and (pr.microbatches, pr.rows) == (4, 64), pr
    assert trace.metadata.get("pp_probe") is True     # what was asked, in the trace
    assert sorted(pr.stages) == [0, 1] and all(s[0] == (32, 64, 128)
                                               for s in pr.stages.values())
    for sh in trace.metadata["shards"]:
        p = (sh.get("pipeline") or {}).get("probe")
        if p is None:
            continue
        rank = int(sh["rank"])
        last = truth[rank]["iterations"][-1]["end"]
        assert p["start_ns"] >= last, (p["start_ns"], last)
    tab = trace.table.to_pylist()
    for rank in (0, 1):
        end = truth[rank]["iterations"][-1]["end"]
        late = [r for r in tab if r["rank"] == rank and r["kind"] == "span"
                and r["cat"] in ("forward", "backward", "pipeline") and r["start_ns"] > end]
        assert not late, late[:3]
    doc = json.loads(_cli("analyze", arrow, "--json").stdout)
    # the probe's time is the job's: inside each rank's run, its shut-down's part
    took = {int(sh["rank"]): (sh["pipeline"]["probe"]["end_ns"]
                              - sh["pipeline"]["probe"]["start_ns"]) / 1e9
            for sh in trace.metadata["shards"] if (sh.get("pipeline") or {}).get("probe")}
    assert sorted(took) == [0, 1], took
    for rank, dur in took.items():
        g = doc["ranks"][str(rank)]["goodput"]
        part = g["shutdown_parts_s"]
        assert part["pp_probe_s"] == pytest.approx(dur, abs=1e-6), (part, dur)
        assert part["pp_probe_s"] + part["other_s"] == pytest.approx(g["badput_s"]["shutdown"])
    pl = doc["parallelism"]["pipeline"]
    c = pl["compute"]
    assert (c["model"], c["probed_rows"], pl["probe_unused"]) == ("probed", [32, 64, 128],
                                                                  None)
    assert "record --pp-probe" in pl["assumptions"][0]
    (w,) = [w for w in pl["what_if"] if w["microbatches"] == 8
            and w["schedule"] == "ScheduleGPipe"]
    band = pp_whatif.BAND["probed"]
    assert w["band"] == (list(band) if band else None)
    lo, hi = band or (-0.10, 0.10)
    drift = abs(np.median(blocks[2]) / np.median(blocks[0]) - 1)
    low = min(blocks[1]) * (1 + lo - drift)
    high = max(blocks[1]) * (1 + hi + drift)
    assert low <= w["t_iter"] <= high, (w["t_iter"], blocks, band, drift)
    text = _cli("analyze", arrow).stdout
    assert "probed at 32, 64, 128 rows" in text
    assert "of it gputrace's pipeline probe" in text
    cal = json.loads(_cli("analyze", arrow, "--calibrate", arrow, "--json").stdout)
    assert cal["parallelism"]["pipeline"]["compute"]["model"] == "probed"  # same count
    page = Path(arrow).with_suffix(".html")   # the report says what the terminal says
    _cli("analyze", arrow, "--calibrate", arrow, "--report", str(page))
    html = page.read_text()
    assert "--calibrate not used: the calibrating run has the same 4 microbatches" in html
    assert "record --pp-probe" in html



def _fused_pipeline(split: tuple[tuple[float, float], ...] = ()) -> Any:
    """A 1F1B pipeline of 2 stages at 8 microbatches as its analysis holds it."""
    from gputrace.analyzers.parallel.pp.pp_model import Compute, Pipeline

    f, b, loss, m = (0.002, 0.003), (0.004, 0.006), 0.0005, 8
    return Pipeline([], "Schedule1F1B", m, 2, 0.0, 0.0, 0, 0.0, 0.0,
                    per_stage=(f, b, loss, 0.001),
                    compute=Compute(tuple((0.0, x * m) for x in f),
                                    tuple((0.0, x * m) for x in b), (0.0, loss * m)),
                    ranks=2, stages_per_rank=1, own=((0.0, 0.0), (0.0, 0.0)),
                    split_probed=split)


def test_the_split_backward_what_if_takes_the_probes_split_and_the_first_stages_rule():
    """From a fused 1F1B run to ZBV (2 stages a rank, V: stages 0 and 3 on rank 0): each
    rank's compute halved over its two stages; the first stage's backward the fused one,
    all of it the weight part (torch runs its input part as nothing); every other stage's
    backward the fused one times its rank's probed split ratio, its weight part the probed
    share (half without a probe). Fused what-ifs do not move with the probe."""
    from gputrace.analyzers.parallel.pp import pipesim, pp_whatif, pporders

    probed = _fused_pipeline(((1.2, 0.6), (1.5, 0.7)))
    plain = _fused_pipeline()
    lay = pporders.layout("ScheduleZBVZeroBubble", 2, 2, 8)
    f = [0.001, 0.0015, 0.0015, 0.001]
    for pl, r0, r1, s0, s1 in ((probed, 1.2, 1.5, 0.6, 0.7), (plain, 1.0, 1.0, 0.5, 0.5)):
        b = [0.002, 0.003 * r1, 0.003 * r1, 0.002 * r0]
        w = [b[0], b[1] * s1, b[2] * s1, b[3] * s0]
        want = pipesim.run(lay.orders, lay.rank_of, f, b, w, 0.0, 0.0005).makespan + 0.001
        got = pp_whatif.predict(pl, "ScheduleZBVZeroBubble", 8, v=2)
        assert got.t_iter == pytest.approx(want), (pl.split_probed, got.t_iter, want)
    for sched in ("Schedule1F1B", "ScheduleGPipe"):
        assert pp_whatif.predict(probed, sched, 8).t_iter == pytest.approx(
            pp_whatif.predict(plain, sched, 8).t_iter)


def test_the_probes_split_is_read_per_stage_or_not_at_all():
    """The split ratio and the weight share per stage from the probe's rounds at the
    recorded rows; nothing where a stage's split was not timed or the count differs."""
    stage = {"rows": [8, 16, 32], "forward_s": [1, 2, 4], "backward_s": [2, 4, 8],
             "input_rounds_s": [2.0, 1.0, 1.0, 1.0, 3.0], "weight_rounds_s": [4.0] * 5}
    md = {"shards": [{"pipeline": {"probe": {"microbatches": 4, "rows": 16, "rounds": 5,
                                             "stages": [stage | {"stage": 0},
                                                        stage | {"stage": 1}]}}}]}
    pr = pp_probed.of_metadata(md)
    assert pp_probed.split_parts(pr, 4, 2) == ((1.25, 0.8), (1.25, 0.8))
    assert pp_probed.split_parts(pr, 8, 2) == ()
    md["shards"][0]["pipeline"]["probe"]["stages"][1] = {
        k: v for k, v in (stage | {"stage": 1}).items() if not k.startswith(("input", "weight"))}
    assert pp_probed.split_parts(pp_probed.of_metadata(md), 4, 2) == ()
