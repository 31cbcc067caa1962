"""Mixture-of-experts as DeepSpeed-MoE and torchtitan lay it out, each recorded once under
`gputrace record` on 2 ranks over gloo and held to the job's own count:

- tests/jobs/ds_moe_train.py: `deepspeed.moe.layer.MoE` under `deepspeed.initialize`, 2
  blocks of 4 experts at ep_size 2 (top-1 and top-2 gating), capacity-padded dispatch with
  even splits and no count exchange, the engine's gradient all-reduces after the backward;
  and with drop_tokens=False, each gate's capacity all-reduced over the EP group;
- tests/jobs/titan_moe_train.py: torchtitan's ExpertParallel (the count exchange, then
  dispatch and combine with split sizes by c10d's functional all-to-alls, the backward's by
  autograd) on its ("efsdp", "ep") and ("fsdp",) meshes, FSDP2 over the blocks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.test_moe import _job_waits, stamp_slack
from tests.test_parallelism import BYTES_TOL, TIME_TOL, record_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return record_run(tmp_path_factory.mktemp("dsmoe") / "ds", "ds_moe_train.py", 2,
                      ("--iterations", "8"))


@pytest.fixture(scope="module")
def ds_keep(tmp_path_factory):
    return record_run(tmp_path_factory.mktemp("dskeep") / "ds", "ds_moe_train.py", 2,
                      ("--iterations", "8", "--keep-tokens"))


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    return record_run(tmp_path_factory.mktemp("titanmoe") / "tt", "titan_moe_train.py", 2,
                      ("--iterations", "8"))


def _own(run, rank: int) -> list[dict]:
    """The job's own MoE log of the iterations gputrace analyzed (each matched to the job's
    iteration it overlaps most)."""
    s = run.analysis.ranks[rank].detail.series
    its = run.truth[rank]["iterations"]
    by = {m["it"]: m for m in run.truth[rank]["moe"]}
    out = []
    for a, b in zip(s.start_ns[s.kept], s.end_ns[s.kept], strict=True):
        ov = [min(b, t["end"]) - max(a, t["start"]) for t in its]
        out.append(by[its[int(np.argmax(ov))]["it"]])
    assert len(out) >= 3, (rank, len(out))
    return out


def _roles_as_the_jobs(run, rank: int, own: list[dict]) -> dict:
    """gputrace's expert-parallel section of `rank`, its roles per phase held to the job's
    own all-to-alls (count per iteration, bytes within 1 %)."""
    ep = run.rank(rank)["parallelism"]["expert_parallel"]
    for phase, key in (("forward", "roles"), ("backward", "roles_backward")):
        want = Counter(a["role"] for o in own for a in o["a2a"] if a["phase"] == phase)
        assert {k: v["count"] for k, v in ep[key].items()} == \
            pytest.approx({k: v / len(own) for k, v in want.items()}), (rank, phase, ep[key])
        for role in want:
            b = sum(a["bytes"] for o in own for a in o["a2a"]
                    if a["phase"] == phase and a["role"] == role) / len(own)
            assert ep[key][role]["bytes"] == pytest.approx(b, rel=BYTES_TOL), \
                (rank, phase, role)
    return ep


def _waits_as_the_jobs(run) -> None:
    """Each rank's wait for the group's last rank (2 ranks, one EP group) within 15 % (or
    1 ms, more by stamp_slack) of the job's own entries."""
    want = _job_waits(run, [0, 1])
    slack = stamp_slack(run, [0, 1])
    g = run.rank(0)["parallelism"]["expert_parallel"]["imbalance"]["groups"][0]
    for r in (0, 1):
        assert g["wait_s"][str(r)] == pytest.approx(sum(want[r].values()), rel=TIME_TOL,
                                                    abs=1e-3 + slack), \
            (r, g["wait_s"], want, slack)


def test_deepspeed_moe_layout(ds):
    """DeepSpeed-MoE: per MoE layer the dispatch and combine as the job's _AllToAll issued
    them, forward and backward (no count exchange: DeepSpeed pads to capacity), EP 2 over
    the job's group; the dispatches' even splits say nothing of tokens, so no tokens are
    claimed (the job's own buffers: experts x capacity slots whatever was routed, tokens
    dropped and padded); the engine's gradient all-reduces are data-parallel gradient sync
    (ZeRO stage 0 shards nothing) and its 4-byte all-reduce in the step is not; the headline's EP on the data-parallel ranks, not
    multiplied in; each rank's wait for the other in the all-to-alls as the job's own
    entries give it (within 15 % or 1 ms)."""
    run = ds
    cfg = run.truth[0]["config"]
    for rank in (0, 1):
        own = _own(run, rank)
        ep = _roles_as_the_jobs(run, rank, own)
        assert "counts" not in ep["roles"] and ep["moe_layers"] == cfg["blocks"]
        assert ep["degree"] == cfg["ep"] and ep["group"] == cfg["ep_group"]
        assert ep["peer_ranks"] == cfg["ep_group"]
        # the job's buffers are its capacity's, whatever its gate routed
        for o in own:
            for a in o["a2a"]:
                blk = o["blocks"][str(a["block"])]
                assert a["bytes"] == blk["slots"] * cfg["d"] * 4
        assert any(b["dropped"] > 0 and b["padded"] > 0 for o in own
                   for b in o["blocks"].values())
        assert ep["even_splits"] is True and ep["dispatch_rows"] == {}
        g = ep["imbalance"]["groups"][0]
        assert g["tokens_by_rank"] == {}
        # no balanced-routing what-if of splits that say nothing of the load, nor its band
        assert g["balanced_saves_s"] is None and g["band"] is None and \
            g["band_source"] is None, g
        # the engine's gradient all-reduces (dense, then experts') in the backward, its
        # 4-byte one in the step
        ar = run.rank(rank)["collectives"]["kinds"]["all_reduce"]
        calls = [c for c in run.truth[rank]["calls"]
                 if c["kind"] == "all_reduce" and c["it"] == own[0]["it"]]
        grads = [c["bytes"] for c in calls if c["phase"] == "backward"]
        assert len(grads) == 2 and ar["gradient"], ar
        got = {k: v for k, v in ar["parallelism"].items() if k != "other"}
        assert set(got) == {"dp"}, ar     # ZeRO stage 0 shards nothing
        assert sum(v["count"] for v in got.values()) == pytest.approx(len(grads))
        assert sum(v["bytes"] for v in got.values()) == pytest.approx(sum(grads),
                                                                     rel=BYTES_TOL)
        assert ar["parallelism"]["other"]["count"] == \
            pytest.approx(sum(c["phase"] == "update" for c in calls))
    assert "capacity-padded buffers" in run.text and "mean tokens (" not in run.text
    assert f"DP 2 (EP {cfg['ep']} on the same ranks), 2 ranks" in run.text
    # its sharded reading names what ZeRO stage 0 runs: all-reduces, nothing gathered
    assert "DeepSpeed ZeRO-0 (data parallel), 2 ranks" in run.text
    assert "comm: all-reduces (all of it)" in run.text
    assert "all-gathers" not in run.text and "reduce-scatters" not in run.text
    assert "other (under 1 KiB each, not gradient" in run.text
    _waits_as_the_jobs(run)


def test_deepspeed_moe_keeping_every_token(ds_keep):
    """DeepSpeed-MoE with drop_tokens=False: each gate's all-reduce of its most-loaded
    expert's count over the EP group before the dispatch is expert parallel (`capacity`),
    as many and as large as the job's own, not a gradient nor a norm or a flag; the
    all-to-alls still pair as dispatch and combine; the headline counts both; each rank's
    wait for the group's last rank, which the capacity all-reduce now takes first, as the
    job's own entries give it (within 15 % or 1 ms)."""
    run = ds_keep
    cfg = run.truth[0]["config"]
    for rank in (0, 1):
        own = _own(run, rank)
        assert all(b["dropped"] == 0 for o in own for b in o["blocks"].values())
        ep = _roles_as_the_jobs(run, rank, own)     # capacity, dispatch, combine
        assert ep["capacity"] == pytest.approx(cfg["blocks"])
        assert ep["count"] == pytest.approx(
            sum(a["role"] != "capacity" for a in own[0]["a2a"]))
        ar = run.rank(rank)["collectives"]["kinds"]["all_reduce"]["parallelism"]
        calls = [c for c in run.truth[rank]["calls"]
                 if c["kind"] == "all_reduce" and c["it"] == own[0]["it"]
                 and c["phase"] == "forward"]
        assert ar["ep"]["count"] == pytest.approx(len(calls)) == cfg["blocks"]
        assert ar["ep"]["bytes"] == pytest.approx(sum(c["bytes"] for c in calls))
    assert "EP 8 all-to-alls and 2 capacity all-reduces per iteration" in run.text
    assert "expert parallel (the capacity agreed before dispatch)" in run.text
    _waits_as_the_jobs(run)


def test_torchtitan_moe_layout(titan):
    """torchtitan's layout: per MoE layer the count exchange (its functional all-to-all of
    int64 counts on mesh dimension ep) apart, dispatch and combine forward as the job called
    them and backward as autograd ran them (the combine's gradient first), bytes within 1 %;
    EP 2 on the job's ep mesh; the tokens each rank's experts received as the job counted
    them and the most-loaded rank the job's; FSDP2's gathers and reduce-scatters as many
    as the job's ProcessGroup counted (the experts' efsdp mesh of 1 rank issues none); the
    headline's EP on the FSDP ranks, not multiplied in."""
    run = titan
    cfg = run.truth[0]["config"]
    tokens = {}
    for rank in (0, 1):
        own = _own(run, rank)
        ep = _roles_as_the_jobs(run, rank, own)
        order = [(a["block"], a["role"]) for a in own[0]["a2a"] if a["phase"] == "backward"]
        assert order == [(2, "combine"), (2, "dispatch"), (1, "combine"), (1, "dispatch")]
        assert ep["moe_layers"] == cfg["blocks"] and ep["even_splits"] is False
        assert ep["degree"] == cfg["ep"] and ep["group"] == cfg["ep_group"]
        groups = run.rank(rank)["parallelism"]["groups"]
        assert groups["ep"]["mesh_dim"] == "ep" and groups["fsdp"]["mesh_dim"] != "ep"
        tokens[rank] = float(np.mean([sum(sum(v) for v in o["received"].values())
                                      for o in own]))
        kinds = run.rank(rank)["collectives"]["kinds"]
        for kind in ("all_gather", "reduce_scatter"):
            n = Counter(c["it"] for c in run.truth[rank]["calls"] if c["kind"] == kind)
            assert kinds[kind]["parallelism"]["fsdp"]["count"] == \
                pytest.approx(np.median([n[o["it"]] for o in own])), (rank, kind)
        assert set(kinds["all_to_all"]["parallelism"]) == {"ep"}
    g = run.rank(0)["parallelism"]["expert_parallel"]["imbalance"]["groups"][0]
    got = {int(k): v for k, v in g["tokens_by_rank"].items()}
    assert got == pytest.approx(tokens, rel=0.02)
    assert g["most_loaded_rank"] == max(tokens, key=lambda r: tokens[r])
    assert f"(EP {cfg['ep']} on the same ranks), 2 ranks" in run.text


def test_torchtitan_waits_for_the_groups_last_rank(titan):
    """Each rank's wait in torchtitan's all-to-alls for the other rank to enter them (count
    exchange, dispatch and combine, forward and backward), in all and per MoE layer, as the
    job's own entries on the host's monotonic clock give it (the last rank's entry less its
    own, summed per iteration over the iterations gputrace analyzed): within 15 % or 1 ms
    (more by stamp_slack)."""
    run = titan
    own = {r: _own(run, r) for r in (0, 1)}
    n = len(own[0])
    assert [o["it"] for o in own[0]] == [o["it"] for o in own[1]]
    want: dict[int, dict[int, float]] = {0: {}, 1: {}}
    for k in range(n):
        calls = [own[r][k]["a2a"] for r in (0, 1)]
        assert [(a["block"], a["role"], a["phase"]) for a in calls[0]] == \
            [(a["block"], a["role"], a["phase"]) for a in calls[1]]
        for x in range(len(calls[0])):
            last = max(c[x]["entry"] for c in calls)
            for r in (0, 1):
                block = calls[r][x]["block"]
                want[r][block] = want[r].get(block, 0.0) + (last - calls[r][x]["entry"]) / 1e9 / n
    slack = stamp_slack(run, [0, 1], per_s=1e9)
    g = run.rank(0)["parallelism"]["expert_parallel"]["imbalance"]["groups"][0]
    for r in (0, 1):
        assert g["wait_s"][str(r)] == pytest.approx(sum(want[r].values()), rel=TIME_TOL,
                                                    abs=1e-3 + slack), \
            (r, g["wait_s"], want, slack)
        got = {int(k): v for k, v in g["wait_by_layer"][str(r)].items()}
        assert got == pytest.approx(want[r], rel=TIME_TOL, abs=1e-3 + slack), \
            (r, got, want[r], slack)
