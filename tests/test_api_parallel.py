"""`gputrace.analyze(...)`'s tables of the parallelisms beyond data parallelism (tp_layers,
tp_what_if, pipeline_stages, pipeline_what_if, expert_parallel): equal to the `--json`
document's `parallelism` sections, with the figures built traces of known answers give,
and with their columns and no rows for a run without the dimension."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gputrace
from gputrace.report import tables_parallel as tpar
from tests.test_api import cli_json, two_ranks
from tests.tracebuilder import Builder

TP_GROUP = {"size": 2, "ranks": [0, 1], "name": "0",
            "mesh": {"dim": "tp", "dims": ["tp"], "shape": [2]}}


def _tp_trace(path: Path) -> Path:
    """Two TP ranks, 6 iterations of 100 ms: forward 5-40 (block1 5-20, block2 20-40), a
    synchronous TP all-reduce in each block's forward (3 and 4 ms) and one in block2's
    backward (2 ms), backward 40-80, update 85-95."""
    b = Builder()
    for rank in (0, 1):
        for k in range(6):
            t = k * 100

            def ar(s, e, phase, t=t, rank=rank, k=k):
                b.span("comm", t + s, t + e, name="all_reduce", rank=rank, step=k,
                       nbytes=1000, args={"kind": "all_reduce", "phase": phase,
                                          "async": False, "bytes_out": 1000,
                                          "group": TP_GROUP})
            b.span("iteration", t, t + 100, step=k, rank=rank)
            b.span("forward", t + 5, t + 40, step=k, rank=rank)
            b.span("forward", t + 5, t + 20, name="block1", layer=1, step=k, rank=rank)
            b.span("forward", t + 20, t + 40, name="block2", layer=2, step=k, rank=rank)
            ar(15, 18, "forward")
            ar(35, 39, "forward")
            b.span("backward", t + 40, t + 80, step=k, rank=rank)
            b.span("backward", t + 40, t + 60, name="block2", layer=2, step=k, rank=rank)
            b.span("backward", t + 60, t + 80, name="block1", layer=1, step=k, rank=rank)
            ar(50, 52, "backward")
            b.span("update", t + 85, t + 95, step=k, rank=rank)
    return b.write_by_rank(path, world_size=2)


def _pp_trace(path: Path) -> Path:
    """A 2-stage GPipe pipeline of 2 microbatches, a rank per stage, 6 iterations of 100 ms:
    stage 0 runs its forwards 2-12 and 13-23 and its backwards 60-75 and 75-90, stage 1 its
    forwards 13-23 and 24-34 and backwards 34-49 and 49-64; the activations and gradients
    go as synchronous send/recv between them."""
    b = Builder()
    acts = {0: [("forward", 0, 2, 12), ("forward", 1, 13, 23),
                ("backward", 0, 60, 75), ("backward", 1, 75, 90)],
            1: [("forward", 0, 13, 23), ("forward", 1, 24, 34),
                ("backward", 0, 34, 49), ("backward", 1, 49, 64)]}
    p2p = {0: [(12, 13), (23, 24), (24, 60)], 1: [(2, 13), (23, 24), (64, 66)]}
    for stage in (0, 1):
        for k in range(6):
            t = k * 100
            b.span("iteration", t, t + 100, step=k, rank=stage)
            b.span("pipeline", t + 2, t + (90 if stage == 0 else 66), name="step",
                   rank=stage, step=k,
                   args={"schedule": "ScheduleGPipe", "microbatches": 2, "stages": [stage],
                         "num_stages": 2})
            for what, mb, s, e in acts[stage]:
                b.span("pipeline", t + s, t + e, name=what, rank=stage, step=k,
                       args={"stage": stage, "mb": mb})
                b.span(what, t + s, t + e, rank=stage, step=k)
            for s, e in p2p[stage]:
                b.span("comm", t + s, t + e, name="send_recv", rank=stage, step=k,
                       nbytes=4096, args={"kind": "send_recv", "async": False,
                                          "pp": {"stage": stage},
                                          "group": {"size": 2, "ranks": [0, 1], "name": "0"}})
            b.span("update", t + 92, t + 95, rank=stage, step=k)
    return b.write_by_rank(path, world_size=2)


def _ep_trace(path: Path) -> Path:
    """Two EP ranks, a MoE layer's dispatch (10-12) and combine (25-28) all-to-all in each
    forward; rank 0 sends 2000 + 2000 bytes each time, rank 1 500 + 1500."""
    b = Builder()
    peers = {0: [2000, 2000], 1: [500, 1500]}
    for rank in (0, 1):
        for k in range(6):
            t = k * 100
            b.span("iteration", t, t + 100, step=k, rank=rank)
            b.span("forward", t + 5, t + 40, step=k, rank=rank)
            for s, e in ((10, 12), (25, 28)):
                b.span("comm", t + s, t + e, name="all_to_all", rank=rank, step=k,
                       nbytes=sum(peers[rank]),
                       args={"kind": "all_to_all", "phase": "forward", "async": False,
                             "group": {"size": 2, "ranks": [0, 1], "name": "0"},
                             "peers": peers[rank]})
            b.span("backward", t + 40, t + 80, step=k, rank=rank)
            b.span("update", t + 85, t + 95, step=k, rank=rank)
    return b.write_by_rank(path, world_size=2)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("par")
    return {"tp": _tp_trace(d / "tp.arrow"), "pp": _pp_trace(d / "pp.arrow"),
            "ep": _ep_trace(d / "ep.arrow"), "ddp": two_ranks(d / "ddp.arrow")}


def _result(path: Path) -> tuple[gputrace.Result, dict]:
    r = gputrace.analyze(path, progress=False)
    text = cli_json(str(path))
    assert r.to_json() + "\n" == text
    return r, json.loads(text)


def _empty(r: gputrace.Result, *names: str) -> None:
    for name in names:
        t = r.table(name)
        assert len(t) == 0 and t.columns, name
        cols = {"tp_layers": tpar.TP_LAYER_COLUMNS, "tp_what_if": tpar.TP_WHAT_IF_COLUMNS,
                "pipeline_stages": tpar.STAGE_COLUMNS,
                "pipeline_what_if": tpar.PIPELINE_WHAT_IF_COLUMNS,
                "expert_parallel": tpar.EP_COLUMNS}[name]
        assert t.columns == cols


def test_tp_tables(traces):
    r, doc = _result(traces["tp"])
    t = r.table("tp_layers")
    assert t.columns == tpar.TP_LAYER_COLUMNS
    rows = [x for x in t.records() if x["rank"] == 0]
    assert [(x["layer"], x["name"], x["phase"], x["count"], x["bytes"]) for x in rows] == [
        (1, "block1", "forward", 1.0, 1000.0), (2, "block2", "forward", 1.0, 1000.0),
        (2, "block2", "backward", 1.0, 1000.0)]
    assert [x["exposed_s"] for x in rows] == pytest.approx([0.003, 0.004, 0.002])
    for rank, rd in doc["ranks"].items():    # every rank's, as the document says
        mine = [x for x in t.records() if x["rank"] == int(rank)]
        layers = rd["parallelism"]["tensor_parallel"]["layers"]
        assert [(x["layer"], x["exposed_s"]) for x in mine] == \
            [(y["layer"], y["exposed_s"]) for y in layers]
    w = r.table("tp_what_if")
    shown = [x for x in w.records() if x["rank"] == doc["rank"]]
    assert [x["degree"] for x in shown] == [1, 2, 4, 8]
    assert [x["t_iter"] for x in shown] == \
        [y["t_iter"] for y in doc["parallelism"]["tensor_parallel"]["what_if"]]
    measured = next(x for x in shown if x["measured"])
    assert measured["degree"] == 2
    assert measured["t_iter"] == pytest.approx(doc["breakdown"]["t_iter"]["mean"])
    assert doc["breakdown"]["t_tp"]["mean"] == pytest.approx(0.009)
    _empty(r, "pipeline_stages", "pipeline_what_if", "expert_parallel")


def test_pipeline_tables(traces):
    pytest.importorskip("pandas")
    r, doc = _result(traces["pp"])
    pl = doc["parallelism"]["pipeline"]
    st = r.to_pandas("pipeline_stages")
    assert list(st.columns) == list(tpar.STAGE_COLUMNS)
    assert list(st.stage) == [0, 1] and list(st["rank"]) == [0, 1]
    assert st.forward_s.tolist() == pytest.approx([0.010, 0.010])
    assert st.backward_s.tolist() == pytest.approx([0.015, 0.015])
    assert st.bubble_s.tolist() == [s["bubble_s"] for s in pl["stages"]]
    assert st.bubble_s[0] == pytest.approx(0.088 - 0.050)    # the step less its compute
    assert st.bubble_share.tolist() == pytest.approx(
        [s["bubble_s"] / s["t_iter"] for s in pl["stages"]])
    assert st.slowest.tolist() == [s["stage"] == pl["slowest_stage"] for s in pl["stages"]]
    w = r.table("pipeline_what_if")
    # a list in the document (a what-if's measured error band) is a tuple in a table's cell
    assert w.records() == [{k: tuple(v) if isinstance(v, list) else v for k, v in x.items()}
                           for x in pl["what_if"]]
    assert any(x["band"] for x in w.records())
    assert {x["schedule"] for x in w.records()} >= {"ScheduleGPipe", "Schedule1F1B"}
    _empty(r, "tp_layers", "tp_what_if", "expert_parallel")


def test_expert_parallel_table(traces):
    r, doc = _result(traces["ep"])
    t = {x["rank"]: x for x in r.table("expert_parallel").records()}
    assert sorted(t) == [0, 1]
    assert (t[0]["count"], t[0]["bytes"], t[1]["bytes"]) == pytest.approx((2, 8000, 4000))
    assert t[0]["peer_bytes"] == pytest.approx((4000, 4000))
    assert t[1]["peer_bytes"] == pytest.approx((1000, 3000))
    assert (t[0]["dispatch_count"], t[0]["combine_count"]) == pytest.approx((1, 1))
    assert t[0]["moe_layers"] == 1
    assert t[0]["dispatch_exposed_s"] == pytest.approx(0.002)
    assert t[0]["combine_exposed_s"] == pytest.approx(0.003)
    assert t[0]["bytes_over_mean"] == pytest.approx(8000 / 6000)
    assert t[1]["bytes_over_mean"] == pytest.approx(4000 / 6000)
    assert t[0]["most_loaded"] and not t[1]["most_loaded"]
    # both ranks enter each all-to-all at once: neither waits for the other
    assert (t[0]["wait_s"], t[1]["wait_s"]) == pytest.approx((0.0, 0.0))
    imb = doc["parallelism"]["expert_parallel"]["imbalance"]
    assert imb["ratio"] == pytest.approx(t[0]["bytes_over_mean"])
    _empty(r, "tp_layers", "tp_what_if", "pipeline_stages", "pipeline_what_if")


def test_a_data_parallel_run_has_them_empty(traces):
    r, doc = _result(traces["ddp"])
    assert doc["parallelism"] is None
    _empty(r, *tpar.TABLES)
    assert set(tpar.TABLES) <= set(gputrace.api.TABLES)
    with pytest.raises(KeyError, match="tp_layers"):
        r.table("nope")
