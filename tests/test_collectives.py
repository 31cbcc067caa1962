"""Every torch.distributed collective recorded: real 2-rank jobs over gloo on the CPU under
`gputrace record` (FSDP2 resharding after forward and not, FSDP1 wrapped per block, an
MoE-like exchange issuing its own collectives), each against the job's own count of what
its process group ran (tests/jobs/collective_truth.py: the ProcessGroup's methods, a layer
below the torch.distributed functions gputrace wraps) and its own timed waits."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("torch")

from gputrace.trace import load  # noqa: E402

JOBS = Path(__file__).resolve().parent / "jobs"
sys.path.insert(0, str(JOBS))
from record_comm_traces import record  # noqa: E402

pytestmark = pytest.mark.slow
ITERATIONS = 10
FSDP = ("fsdp2", "fsdp2-keep", "fsdp2-prefetch", "fsdp1")
UNITS = ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]   # forward order


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Each configuration recorded once for the module: (comm spans by rank, truth by
    rank)."""
    out = tmp_path_factory.mktemp("comm")
    cache: dict[str, tuple[dict[int, list[dict]], dict[int, dict]]] = {}
    logs: dict[str, str] = {}
    forwards: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    backwards: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))

    def get(name: str):
        if name not in cache:
            p = record(name, out)
            assert p.returncode == 0, f"{name}:\n{p.stdout}\n{p.stderr[-3000:]}"
            assert "Traceback" not in p.stderr, p.stderr[-3000:]
            logs[name] = p.stdout + p.stderr
            rows = load(out / f"{name}.arrow").table.to_pylist()
            spans = defaultdict(list)
            for r in rows:
                if r["kind"] == "span" and r["cat"] == "comm":
                    r["a"] = json.loads(r["args"])
                    spans[r["rank"]].append(r)
                elif r["kind"] == "span" and r["cat"] == "forward" and r["layer"] >= 1:
                    forwards[name][r["rank"]].append(r)
                elif r["kind"] == "span" and r["cat"] == "backward" and r["layer"] >= 1:
                    backwards[name][r["rank"]].append(r)
            truth = {k: json.loads((out / f"{name}.rank{k}.json").read_text())
                     for k in (0, 1)}
            cache[name] = (dict(spans), truth)
        return cache[name]

    get.logs = logs
    get.forwards = forwards
    get.backwards = backwards
    return get


def per_iteration(spans, truth):
    """[(job iteration, the job's own collectives, gputrace's spans issued inside it)]."""
    out = []
    for it in truth["iterations"]:
        mine = sorted((r for r in spans if it["start"] <= r["start_ns"] <= it["end"]),
                      key=lambda r: r["start_ns"])
        calls = [c for c in truth["calls"] if c["it"] == it["it"]]
        out.append((it, calls, mine))
    return out


def assert_matches_truth(spans, truth):
    """Per iteration: the same collectives by kind and phase, the same count, bytes within
    1 %, all on one step, steps consecutive."""
    steps = []
    for it, calls, mine in per_iteration(spans, truth):
        want, got = defaultdict(list), defaultdict(list)
        for c in calls:
            want[(c["kind"], c["phase"])].append(c["bytes"])
        for r in mine:
            assert r["name"] == r["a"]["kind"]
            got[(r["name"], r["a"]["phase"])].append(r["bytes"])
        assert sorted(got) == sorted(want), (it["it"], dict(got), dict(want))
        for key, b in want.items():
            assert len(got[key]) == len(b), (it["it"], key)
            for x, y in zip(sorted(got[key]), sorted(b), strict=True):
                assert abs(x - y) <= 0.01 * y, (it["it"], key, x, y)
        assert len({r["step"] for r in mine}) == 1, (it["it"], {r["step"] for r in mine})
        steps.append(mine[0]["step"])
    assert steps == list(range(steps[0], steps[0] + len(steps))), steps
    assert len(steps) == ITERATIONS


@pytest.mark.parametrize("name", FSDP)
def test_fsdp_collectives_match_the_jobs_own_count(recorded, name):
    spans, truth = recorded(name)
    for rank in (0, 1):
        assert_matches_truth(spans[rank], truth[rank])
        for r in spans[rank]:
            assert r["a"]["group"]["size"] == 2 and r["a"]["group"]["ranks"] == [0, 1]
            assert r["end_ns"] >= r["start_ns"]
            if r["name"] == "all_gather":      # each rank gathers the whole
                assert r["a"]["bytes_out"] == 2 * r["bytes"]
            if r["name"] == "reduce_scatter":
                assert 2 * r["a"]["bytes_out"] == r["bytes"]


@pytest.mark.parametrize("name", FSDP)
def test_fsdp_each_layers_backward_in_every_iteration(recorded, name):
    """When each layer's gradients are ready: a backward span per layer (the blocks and the
    layers around them) in every iteration after the first. FSDP2 sets its sharded
    parameters' gradients after their reduce-scatter, outside autograd, and calls their
    post-accumulate-grad hooks itself: the first backward shows that."""
    recorded(name)
    for rank in (0, 1):
        by_step = defaultdict(set)
        for r in recorded.backwards[name][rank]:
            by_step[r["step"]].add(r["layer"])
        steps = sorted(by_step)
        assert len(steps) == ITERATIONS, steps
        later = [by_step[s] for s in steps[1:]]
        assert all(x == later[0] for x in later), later
        assert len(later[0]) >= len(UNITS), later[0]   # the 4 blocks and 1 layer or more


@pytest.mark.parametrize("name", FSDP)
def test_fsdp_units_roles_and_order(recorded, name):
    """Forward all-gathers unit by unit in forward order (1..U), reduce-scatters in backward
    once per unit, re-gathers in backward only when the forward resharded."""
    spans, truth = recorded(name)
    fsdp = "fsdp1" if name == "fsdp1" else "fsdp2"
    for rank in (0, 1):
        for _it, calls, mine in per_iteration(spans[rank], truth[rank]):
            for r in mine:
                assert r["a"]["fsdp"] == fsdp and r["a"]["unit"] == UNITS[r["layer"] - 1]
            fwd = [r for r in mine if r["a"]["phase"] == "forward"]
            assert [r["name"] for r in fwd] == ["all_gather"] * len(UNITS)
            assert [r["layer"] for r in fwd] == [1, 2, 3, 4, 5]
            assert {r["a"]["role"] for r in fwd} == {"unshard"}
            bwd = [r for r in mine if r["a"]["phase"] == "backward"]
            rs = [r for r in bwd if r["name"] == "reduce_scatter"]
            assert sorted(r["layer"] for r in rs) == [1, 2, 3, 4, 5]
            assert {r["a"]["role"] for r in rs} == {"reduce_grad"}
            # backward reduces the blocks from the output side: block 4 first, block 1 last
            blocks = [r["layer"] for r in rs if r["layer"] > 1]
            assert blocks == [5, 4, 3, 2], blocks
            gathers = [r for r in bwd if r["name"] == "all_gather"]
            want = [c for c in calls if c["phase"] == "backward" and c["kind"] == "all_gather"]
            assert len(gathers) == len(want)
            if name == "fsdp2-keep":
                assert not gathers
            else:
                assert {r["a"]["role"] for r in gathers} == {"reshard_gather"}
                # the blocks' re-gathers are issued ahead by FSDP's backward prefetch
                assert sum(r["a"]["prefetch"] for r in gathers) >= 3, gathers
                # a block's parameters are back before its gradients are reduced
                for g in gathers:
                    r = next(x for x in rs if x["layer"] == g["layer"])
                    assert g["start_ns"] < r["start_ns"]


def test_fsdp2_prefetch_is_async_and_its_waits_are_the_units(recorded):
    """Explicit prefetch with asynchronous all-gathers: blocks 2..4 are gathered ahead in
    forward while the previous block computes, and FSDP's wait for each (in the unit's
    pre-forward) is the record's `wait`, after its issue and before the unit's compute."""
    spans, truth = recorded("fsdp2-prefetch")
    waited = 0
    for rank in (0, 1):
        for _it, _calls, mine in per_iteration(spans[rank], truth[rank]):
            fwd = [r for r in mine if r["a"]["phase"] == "forward"]
            assert all(r["a"]["async"] for r in fwd)
            assert [r["a"]["prefetch"] for r in fwd] == [False, False, True, True, True]
            for r in mine:
                if "wait" in r["a"]:
                    ws, we = r["a"]["wait"]
                    assert r["start_ns"] <= ws <= we and r["end_ns"] <= we
                    waited += 1
            # block k's gather is issued before block k-1 computes (its fc1's forward span:
            # layers 1 inp, 2-3 blocks.0, 4-5 blocks.1, ...)
            layers = recorded.forwards["fsdp2-prefetch"][rank]
            for r in fwd[2:]:
                fc1 = 2 * (r["layer"] - 3) + 2
                (f,) = [f for f in layers if f["layer"] == fc1 and f["step"] == r["step"]]
                assert r["start_ns"] < f["start_ns"], (r["layer"], fc1)
    assert waited > 0


def test_hsdp_gradients_all_reduced_per_unit(recorded):
    """HSDP replicated across the 2 ranks and sharded over 1: no all-gather, no
    reduce-scatter on the wire, one gradient all-reduce per unit in backward."""
    spans, truth = recorded("fsdp2-hsdp")
    for rank in (0, 1):
        assert_matches_truth(spans[rank], truth[rank])
        for _it, _calls, mine in per_iteration(spans[rank], truth[rank]):
            assert [r["name"] for r in mine] == ["all_reduce"] * len(UNITS)
            assert {r["a"]["role"] for r in mine} == {"hsdp_all_reduce"}
            assert [r["layer"] for r in mine] == [5, 4, 3, 2, 1]
            assert [r["a"]["unit"] for r in mine] == UNITS[::-1]


def test_moe_exchange_kinds_bytes_and_waits(recorded):
    spans, truth = recorded("moe")
    for rank in (0, 1):
        assert_matches_truth(spans[rank], truth[rank])
        mine = spans[rank]
        kinds = {r["name"] for r in mine}
        assert {"all_gather", "broadcast", "all_to_all", "all_reduce", "send_recv"} <= kinds
        for r in mine:
            assert r["layer"] == -1 and "fsdp" not in r["a"]
            if r["name"] == "all_gather":
                assert r["a"]["bytes_out"] == 2 * r["bytes"]
            if r["name"] == "send_recv":   # rank 0 sends, rank 1 receives
                assert (r["bytes"], r["a"]["bytes_out"]) == ((256, 0) if rank == 0
                                                             else (0, 256))
        # the job's own timed wait() on each async collective holds gputrace's wait
        waits = truth[rank]["waits"]
        assert len(waits) == 2 * ITERATIONS
        stood = []     # (the job's wait, the record's) where the job stood still
        for w in waits:
            r = max((r for r in mine if r["name"] == w["kind"] and r["a"]["async"] and
                     r["start_ns"] <= w["start"]), key=lambda r: r["start_ns"])
            if "wait" not in r["a"]:   # it had completed before the job asked
                # (or in the microseconds between the job's look and its wait)
                assert not w["running"] or r["end_ns"] - w["start"] < 200_000, (w, r)
                assert r["end_ns"] <= w["end"]
                continue
            ws, we = r["a"]["wait"]
            assert w["start"] <= ws <= we <= w["end"], (w, r["a"]["wait"])
            assert r["start_ns"] <= ws and r["end_ns"] <= we
            if w["running"]:
                stood.append((w["end"] - w["start"], we - ws))
        # the job stood still in those waits: so did the record, give or take the
        # scheduling of two threads' clock reads (tens of us; now and then a busy machine
        # preempts one thread for milliseconds, so no single wait is held to it)
        if stood:
            missed = sorted(job - mine for job, mine in stood)
            assert missed[len(missed) // 2] < 500_000, (rank, missed)
            job_total = sum(job for job, _ in stood)
            mine_total = sum(mine for _, mine in stood)
            assert mine_total >= 0.8 * job_total - 500_000 * len(stood), (rank, stood)
        # rank 1 joins each all-reduce 50 ms late: rank 0 waited for most of them
        if rank == 0:
            assert sum(w["running"] for w in waits if w["kind"] == "all_reduce") >= 5
        sync = [r for r in mine if not r["a"]["async"]]
        assert sync and all("wait" not in r["a"] for r in sync)


def test_every_other_call_and_a_failure_of_ours(recorded, tmp_path_factory):
    """all_gather_into_tensor (all_gather_single inside torch: one record), reduce_scatter
    of lists and tensors, reduce, gather, scatter, barrier, isend/irecv, an async all_reduce
    nobody waits on, batch_isend_irecv (one record for the batch); then the recorder's own
    bookkeeping fails: the collectives still run right and the failure is one line."""
    spans, truth = recorded("tour")
    log = recorded.logs["tour"]
    assert "RESULT ok" in log
    # one line per rank (the two may share a line of the combined log)
    assert log.count("instrumentation failed") == 2, log[-3000:]
    assert log.count("instrumentation failed in torch.distributed.all_reduce "
                     "(RuntimeError: bookkeeping bug)") == 2
    for rank in (0, 1):
        t = truth[rank]
        assert len(t["iterations"]) == 3
        for it, calls, mine in per_iteration(spans[rank], t):
            batch = [c for c in calls if c["phase"] == "batch"]
            want = sorted((c["kind"], c["bytes"]) for c in calls if c["phase"] != "batch")
            got = [r for r in mine if not (r["name"] == "send_recv" and r["a"]["async"] and
                                           r["bytes"] and r["a"]["bytes_out"])]
            assert sorted((r["name"], r["bytes"]) for r in got) == want, it["it"]
            # the batch: one record, its sends' bytes in, its receives' out
            (b,) = [r for r in mine if r not in got]
            assert len(batch) == 2 and b["bytes"] == sum(c["bytes"] for c in batch)
            assert b["a"]["bytes_out"] == b["bytes"] and "wait" in b["a"]
            unwaited = [r for r in mine if r["name"] == "all_reduce"]
            assert len(unwaited) == 1 and unwaited[0]["a"]["async"]
            assert "wait" not in unwaited[0]["a"]
            assert all(r["a"]["phase"] == "none" for r in mine)
        after = [r for r in spans[rank] if r["start_ns"] > t["iterations"][-1]["end"]]
        # the broken bookkeeping's all-reduces left no record (and nothing else did)
        assert not [r for r in after if r["name"] == "all_reduce" and
                    not r["a"].get("functional")]


def test_functional_collectives_and_dtensor(recorded):
    """c10d's functional collectives (funcol.all_reduce, all_gather_single) and a DTensor
    gathered whole: each a span from its call to the job's first use of the result, that
    use's wait inside the job's own timing of it."""
    spans, truth = recorded("tour")
    for rank in (0, 1):
        calls = truth[rank]["functional"]
        assert len(calls) == 3
        fc = sorted((r for r in spans[rank] if r["a"].get("functional")),
                    key=lambda r: r["start_ns"])
        assert len(fc) == len(calls), [(r["name"], r["bytes"]) for r in fc]
        for c, r in zip(calls, fc, strict=True):
            assert (r["name"], r["bytes"], r["a"]["bytes_out"]) == \
                (c["kind"], c["bytes"], c["bytes_out"])
            assert r["a"]["async"] and r["a"]["group"]["size"] == 2
            ws, we = r["a"]["wait"]
            assert c["start"] <= ws <= we <= c["end"] and r["end_ns"] == we
            assert r["start_ns"] <= ws
