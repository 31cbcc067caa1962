"""DeepSpeed's pipeline engine as users run it (tests/jobs/ds_pipe_train.py: a
`PipelineModule` split in 2 stages, `engine.train_batch()` over 4 microbatches, 2
ranks over gloo on the CPU), recorded with no change to the job and held against the job's
own count of its collectives and its own clock (each train_batch, each stage's forward,
loss and backward per microbatch); warm-up left out, medians over iterations."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from gputrace.analyzers.parallel.pp import pipesim  # noqa: E402
from tests.test_parallelism import (  # noqa: E402
    BYTES_TOL,
    Run,
    inside,
    record_run,
    stages_clocks,
)

pytestmark = pytest.mark.slow
# one microbatch count: 8 ran the same engine and checks with a longer steady state (one
# recording more); the torch pipelines run 8 (test_pipeline_schedules)
CONFIGS = {"ds-4": ("--microbatches", "4")}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Each job recorded once for the module."""
    out = tmp_path_factory.mktemp("ds_pipe")
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            cache[name] = record_run(out / name, "ds_pipe_train.py", 2,
                                     ("--iterations", "10", *CONFIGS[name]))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sends_and_receives_as_the_job_counts_them(recorded, name):
    """Per iteration and rank, every collective the job issued inside its train_batch is
    recorded, as many of each kind; the sends and receives between the stages 2 per
    microbatch after the first step (which also sends the shapes), bytes sent and received
    within 1 %, every one pipeline parallel from the rank's stage; the stages' table says
    2 per microbatch; no data-parallel speedup or bucket what-if for the pipeline's comm."""
    run = recorded(name)
    m = run.truth[0]["stage"]["microbatches"]
    for rank in (0, 1):
        t = run.truth[rank]
        for it in t["iterations"]:
            mine = inside(run.comm[rank], it)
            calls = [c for c in t["calls"] if c["it"] == it["it"]]
            assert Counter(r["name"] for r in mine) == Counter(c["kind"] for c in calls)
            sr = [r for r in mine if r["name"] == "send_recv"]
            own = [c for c in calls if c["kind"] == "send_recv"]
            if it["it"] > 0:
                assert len(sr) == len(own) == 2 * m, (rank, it["it"], len(sr), len(own))
            sent, got = sum(r["bytes"] for r in sr), sum(c["bytes"] for c in own)
            assert abs(sent - got) <= BYTES_TOL * got, (rank, it["it"], sent, got)
            recv = sum(r["a"]["bytes_out"] for r in sr)
            want = sum(c.get("bytes_out", 0) for c in own)
            assert abs(recv - want) <= BYTES_TOL * want, (rank, it["it"], recv, want)
            assert all(r["a"]["pp"] == {"stage": rank} for r in sr)
        d = run.rank(rank)
        kinds = d["collectives"]["kinds"]
        assert set(kinds["send_recv"]["parallelism"]) == {"pp"}
        assert not kinds["send_recv"]["gradient"]
        (st,) = [s for s in d["parallelism"]["pipeline"]["stages"] if s["rank"] == rank]
        assert st["p2p_count"] == pytest.approx(2 * m)
        assert st["stage"] == rank
        assert d["speedup"]["points"] == [] and d["what_if"] is None
    assert "Predicted speedup (eq." not in run.text and "bucket_cap_mb" not in run.text


@pytest.mark.parametrize("name", list(CONFIGS))
def test_iteration_and_bubble_on_the_stages_clocks(recorded, name):
    """Per stage: t_iter within 5 % of the job's own train_batch loop; the bubble and the
    update (t_pp + t_u) within 15 % of what the stage measured itself: its train_batch less
    its engine's forward and backward instructions; t_u above 0 and at most the update
    instructions' time; median over iterations."""
    stages_clocks(recorded(name))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_headline_and_the_engines_runtime_order(recorded, name):
    """The headline says "pipeline, 2 stages x M microbatches (TrainSchedule, 1F1B order)";
    each train_batch is one `step` span; in every step each stage's microbatch passes come
    in the order pipesim replays for 1F1B (so the analysis replays it as 1F1B), numbered
    0..M-1 per step, the last stage's loss once per microbatch; the job timed M forwards
    and M backwards per iteration itself; the FLOPs line says which engine runs the
    microbatches."""
    run = recorded(name)
    m = run.truth[0]["stage"]["microbatches"]
    head = run.text.splitlines()[0]
    assert f"pipeline, 2 stages x {m} microbatches (TrainSchedule, 1F1B order)" in head, head
    assert "PP 2, 2 ranks" in head and "DP 1" not in head and "single process" not in run.text
    # the FLOPs line names the engine that runs the microbatches, not torch's pipelining
    assert "FLOPs not counted: a pipeline schedule runs the model in microbatches " \
        "(DeepSpeed's pipeline engine)" in run.text, run.text[-800:]
    pl = run.doc["parallelism"]["pipeline"]
    assert (pl["schedule"], pl["recorded_schedule"], pl["microbatches"], pl["num_stages"]) \
        == ("Schedule1F1B", "TrainSchedule", m, 2)
    assert {w["schedule"] for w in pl["what_if"]} >= {"ScheduleGPipe", "Schedule1F1B"}
    losses = [r for r in run.trace.table.to_pylist()
              if r["kind"] == "span" and r["cat"] == "forward" and r["name"] == "loss"]
    for rank in (0, 1):
        spans = run.pipeline[rank]
        steps = sorted((r for r in spans if r["name"] == "step"), key=lambda r: r["start_ns"])
        assert len(steps) == len(run.truth[rank]["iterations"])
        want = pipesim.order("Schedule1F1B", rank, 2, m)
        for st in steps:
            assert st["a"] == {"schedule": "TrainSchedule", "microbatches": m,
                               "stages": [rank], "num_stages": 2}
            mine = sorted((r for r in spans if r["name"] in ("forward", "backward")
                           and st["start_ns"] <= r["start_ns"] <= st["end_ns"]),
                          key=lambda r: r["start_ns"])
            assert [(r["name"][0].upper(), r["a"]["mb"]) for r in mine] == want
            assert all(r["a"]["stage"] == rank for r in mine)
            n_loss = sum(1 for r in losses if r["rank"] == rank
                         and st["start_ns"] <= r["start_ns"] <= st["end_ns"])
            assert n_loss == (m if rank == 1 else 0)
        n = Counter(mb["it"] for mb in run.truth[rank]["microbatches"])
        assert set(n.values()) == {m}
        assert all(mb["backward"] > 0 for mb in run.truth[rank]["microbatches"])


def test_a_deepspeed_pipeline_recorded_with_the_probe_gets_the_probed_what_ifs(tmp_path):
    """`record --pp-probe` on DeepSpeed's engine: each rank's stage module timed at half,
    one and twice the microbatch's rows after the last train_batch (the engine's module,
    on the inputs its ForwardPass gave it), the microbatch what-ifs' compute `probed`, the
    engine's own work per microbatch said to scale with it, and the probe's time the
    job's: in each rank's shut-down."""
    import json

    from gputrace import load
    from gputrace.analyzers.parallel.pp import pp_probed
    from tests.test_parallelism import JOBS, PY, _cli

    prefix = tmp_path / "ds"
    arrow = f"{prefix}.arrow"
    _cli("record", "-q", "-o", arrow, "--pp-probe", "--", PY, "-m", "torch.distributed.run",
         "--standalone", "--nproc_per_node", "2", str(JOBS / "ds_pipe_train.py"),
         str(prefix), "--microbatches", "4", "--iterations", "5", "--global-batch", "128")
    pr = pp_probed.of_metadata(load(arrow).metadata)
    assert pr is not None and (pr.microbatches, pr.rows) == (4, 32), pr
    assert sorted(pr.stages) == [0, 1] and all(s[0] == (16, 32, 64) for s in pr.stages.values())
    doc = json.loads(_cli("analyze", arrow, "--json").stdout)
    pl = doc["parallelism"]["pipeline"]
    assert (pl["compute"]["model"], pl["probe_unused"]) == ("probed", None), pl["compute"]
    assert "DeepSpeed's pipeline engine's own work" in pl["assumptions"][0]
    assert any(w["microbatches"] == 8 and w["t_iter"] > 0 for w in pl["what_if"])
    for r in ("0", "1"):
        assert doc["ranks"][r]["goodput"]["shutdown_parts_s"]["pp_probe_s"] > 0
