"""What-if replay: the pieces against hand-computed answers, then whole hand-built traces
(Case 2 DDP, comm after backward), then the command line."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from gputrace.analyzers.parallel.ddp.replay import MIB, Scenario
from gputrace.analyzers.parallel.ddp.replay_sim import CommCost, buckets_by_cap, fit_cost, simulate
from tests.conftest import run_gputrace
from tests.test_analyze import CASE2_UNITS, run_analysis
from tests.tracebuilder import Builder, ddp_iterations

MS = 1e-3


def test_buckets_fill_from_the_output_side_and_close_at_the_cap():
    ready = {4: 1.0, 3: 2.0, 2: 3.0, 1: 4.0}
    nbytes = {1: 100.0, 2: 200.0, 3: 300.0, 4: 400.0}
    assert buckets_by_cap(ready, nbytes, 500) == [(700.0, 2.0), (300.0, 4.0)]
    assert buckets_by_cap(ready, nbytes, math.inf) == [(1000.0, 4.0)]
    assert buckets_by_cap(ready, nbytes, 1) == [(400.0, 1.0), (300.0, 2.0), (200.0, 3.0),
                                                (100.0, 4.0)]


def test_units_run_one_at_a_time_and_scale_with_the_ring_factor():
    cost = CommCost(alpha_s=0.5, beta_bytes_per_s=100.0, world=2, source="measured")
    buckets = [(300.0, 4.0), (700.0, 2.0)]
    # 700 B ready at 2: 0.5 + 7 -> ends 9.5; 300 B waits for it: 9.5 + 0.5 + 3 = 13
    assert simulate(buckets, cost, 2) == pytest.approx((13.0, 11.0))
    # 4 GPUs move 2(N-1)/N = 1.5 per byte against 1.0 at the 2 measured
    assert simulate(buckets, cost, 4) == pytest.approx((18.0, 16.0))
    # twice the bandwidth: 2 + 0.5 + 3.5 = 6, then 6 + 0.5 + 1.5 = 8
    assert simulate(buckets, cost, 2, bandwidth_x=2.0) == pytest.approx((8.0, 6.0))
    assert simulate(buckets, cost, 1) == pytest.approx((4.0, 0.0))
    link = CommCost(0.0, 100.0, 1, "link")   # one process: ring over the link bandwidth
    assert link.seconds(100.0, 8) == pytest.approx(2 * 7 / 8)


def test_fit_recovers_latency_and_bandwidth():
    nb = np.array([1e6, 2e6, 4e6, 8e6])
    c = fit_cost(nb, 0.002 + nb / 5e9, 2)
    assert c.alpha_s == pytest.approx(0.002) and c.beta_bytes_per_s == pytest.approx(5e9)
    one = fit_cost(np.array([1e6, 1e6]), np.array([0.01, 0.03]), 2)
    assert (one.alpha_s, one.beta_bytes_per_s) == (0.0, pytest.approx(2e6 / 0.04))
    assert fit_cost(np.array([]), np.array([]), 2) is None


def test_case2_trace_on_the_cpu_replays_to_the_hand_computed_timeline(tmp_path):
    """Comm on the CPU (a hand-built gloo-like trace: no GPU records) takes backward's CPU.
    Backward starts at 30 ms; layers end at 40 (layer 4), 55, 70, 85; units of 1 MB are
    busy 40-84 beside backward and 85-92 after it."""
    a = run_analysis(tmp_path, ddp_iterations(Builder(), CASE2_UNITS, update=(92, 98)),
                     skip=1, world_size=2, gpus=(4,),
                     what_if=[Scenario(0, 1.0, 2 * MIB)])
    rp = a.main.replay
    # 4 MB moved in 44 ms beside backward (at most half the CPU: c / 0.5 per byte) and 7 ms
    # alone (c per byte): (22 + 7) ms / 4 MB = 7.25 ns per byte of CPU
    assert rp.cost.alpha_s == 0 and rp.cost.cpu_s_per_byte == pytest.approx(7.25e-9)
    # half the CPU for 44 ms: backward lost 22 ms; with none beside it, it ends at 63
    assert rp.contention_s == pytest.approx(22 * MS)
    assert rp.backward_end_s == pytest.approx(85 * MS)
    # replayed: the freed ready times (40, 47.5, 55, 63) and the same contention give back
    # the measured timeline: the last unit ends at 92, as measured
    assert rp.baseline_t_iter == pytest.approx(100 * MS) and rp.baseline_error == \
        pytest.approx(0, abs=1e-9)
    t = {o.scenario: o for o in rp.outcomes}
    assert t[Scenario(2)].t_iter == pytest.approx(100 * MS)
    # on a CPU the work is the same whatever the buckets: one bucket moves 4 MB alone from
    # 63 ms (29 ms), 2 MiB buckets split the same CPU time differently; both end at 92
    assert t[Scenario(2, 1.0, math.inf)].buckets == 1
    assert t[Scenario(2, 1.0, math.inf)].t_iter == pytest.approx(100 * MS)
    b = t[Scenario(2, 1.0, 2 * MIB)]
    assert b.buckets == 2 and b.t_iter == pytest.approx(100 * MS)
    # 4 GPUs: 1.5 times the bytes per rank; worked through by hand, the last unit ends at
    # 106.5 ms
    assert t[Scenario(4)].t_iter == pytest.approx((100 - 92 + 106.5) * MS)
    assert t[Scenario(4)].extrapolated and t[Scenario(2)].extrapolated is None
    # no link bandwidth known: the host's rate stands for it, so what held the comm back
    # (the host or the link) cannot be told: a faster link is not predicted, and it says
    # why; a slower one lengthens the iteration
    x2 = t[Scenario(2, 2.0)]
    assert math.isnan(x2.t_iter) and "no link bandwidth is known" in x2.withheld
    assert t[Scenario(2, 0.5)].t_iter > 100 * MS
    assert any("no link bandwidth known" in x for x in rp.assumptions)
    # one GPU: no comm, backward with nothing beside it (63 ms), no tail: 71 ms
    assert t[Scenario(2)].speedup == pytest.approx(2 * 71 / 100)
    # each prediction has an interval around it
    assert all(o.low <= o.t_iter <= o.high for o in rp.outcomes if o.withheld is None)


def test_gpu_comm_after_backward_merging_units_saves_their_latency(tmp_path):
    """NCCL on a GPU: units one at a time on their stream, a fixed cost each, no cost to
    the compute beside them. Merging units saves their fixed costs."""
    from gputrace.analyzers.core.frame import build
    from gputrace.analyzers.core.model import build_model
    from gputrace.analyzers.core.steps import analyze_rank
    from gputrace.analyzers.parallel.ddp.replay import replay
    from gputrace.trace import load

    units = [([4], 85, 88), ([3], 88, 91), ([2, 1], 91, 96)]
    path = ddp_iterations(Builder(), units, update=(96, 99)).write(tmp_path / "t.arrow",
                                                                   world_size=2)
    (sp,) = build(load(path).table).ranks.values()
    rs = analyze_rank(sp)
    sel = np.arange(1, rs.iterations.start.size)
    m = build_model(rs, sel)
    rp = replay(rs, sel, m, 2, (2,), on_cpu=False)
    assert m.strategy == "sequential"
    # 1 MB in 3 ms, 2 MB in 5 ms: 1 ms + 2 ms per MB
    assert rp.cost.alpha_s == pytest.approx(1 * MS)
    assert rp.cost.beta_bytes_per_s == pytest.approx(1e6 / (2 * MS))
    assert rp.contention_s == 0 and rp.baseline_error == pytest.approx(0, abs=1e-9)
    one = next(o for o in rp.outcomes if o.scenario == Scenario(2, 1.0, math.inf))
    # all 4 MB at once when backward ends at 85: 1 + 8 ms -> 94 instead of 96
    assert one.buckets == 1 and one.t_iter == pytest.approx(98 * MS)
    # the same trace with comm on the CPU: no fixed cost can be told apart, nothing to save
    cpu = replay(rs, sel, m, 2, (2,), on_cpu=True)
    one = next(o for o in cpu.outcomes if o.scenario == Scenario(2, 1.0, math.inf))
    assert one.t_iter == pytest.approx(100 * MS)


def test_a_link_known_to_be_slower_than_the_host_bounds_a_link_what_if(tmp_path):
    """With the link's bus bandwidth known, a unit moves no faster than it: a run whose
    comm the link held back gets faster with a faster link, one the host held back does
    not."""
    b = ddp_iterations(Builder(), CASE2_UNITS, update=(92, 98))
    # 4 MB in 51 ms of busy time: a 0.095 GB/s link (42 ms for 4 MB) explains it
    slow = run_analysis(tmp_path, b, skip=1, world_size=2, link_bytes_per_s=9.5e7).main.replay
    assert slow.cost.wire_bytes_per_s == 9.5e7 and slow.cost.cpu_s_per_byte == 0
    x2 = next(o for o in slow.outcomes if o.scenario == Scenario(2, 2.0))
    # units of 10.53 ms at x1 (the last ends at 95.53, 3.5 % past the measured 92), 5.26
    # ms at x2 (at 90.26)
    per_mb = 1e6 / 9.5e7 / MS
    assert slow.baseline_error == pytest.approx((85 + per_mb - 92) / 100)
    assert x2.t_iter == pytest.approx((100 - (85 + per_mb) + 85 + per_mb / 2) * MS)
    # a 0.08 GB/s link explains it as well, but the replay on it ends the last unit at 97.5
    # ms: 5.5 % of the iteration past the measured run, so it predicts nothing, and says why
    off = run_analysis(tmp_path, b, skip=1, world_size=2, link_bytes_per_s=8e7).main
    assert off.replay is None and "not reproduce this run" in off.replay_unavailable
    # a fast link (10 GB/s) cannot explain it: the host's CPU does, and x2 changes nothing
    fast = run_analysis(tmp_path, b, skip=1, world_size=2, link_bytes_per_s=1e10).main.replay
    assert fast.cost.cpu_s_per_byte > 0
    x2 = next(o for o in fast.outcomes if o.scenario == Scenario(2, 2.0))
    assert x2.t_iter == pytest.approx(fast.measured_t_iter)


def test_one_process_replays_over_the_link_bandwidth_or_not_at_all(tmp_path):
    b = Builder()
    for k in range(6):
        base = k * 100
        b.span("iteration", base, base + 100, step=k)
        b.span("forward", base, base + 40, step=k)
        for ly, s, e in ((2, 40, 60), (1, 60, 80)):
            b.span("backward", base + s, base + e, layer=ly, step=k, nbytes=10_000_000)
        b.span("update", base + 80, base + 90, step=k)
    assert run_analysis(tmp_path, b, skip=1).main.replay is None
    rp = run_analysis(tmp_path, b, skip=1, gpus=(8,), link_bytes_per_s=1e9).main.replay
    assert rp.cost.source == "link" and rp.layers_known
    o = {x.scenario: x for x in rp.outcomes}
    # DDP's default buckets: a 1 MiB first bucket (layer 2, ready at 60 ms: 2*7/8 * 10 MB
    # / 1 GB/s = 17.5 ms, to 77.5), then layer 1 at 80 ms (to 97.5)
    assert o[Scenario(8)].buckets == 2
    assert o[Scenario(8)].t_iter == pytest.approx(0.100 + 0.0175)
    assert o[Scenario(8, 1.0, MIB)].t_iter == pytest.approx(0.100 + 0.0175)
    # 25 MiB buckets hold both layers (20 MB, ready at 80 ms): 35 ms
    assert o[Scenario(8, 1.0, 25 * MIB)].buckets == 1
    assert o[Scenario(8, 1.0, 25 * MIB)].t_iter == pytest.approx(0.100 + 0.035)
    assert o[Scenario(8)].speedup == pytest.approx(8 * 0.100 / 0.1175)


def test_what_if_on_the_command_line(tmp_path):
    path = ddp_iterations(Builder(), CASE2_UNITS).write(tmp_path / "t.arrow", world_size=2)
    p = run_gputrace("analyze", str(path), "--json", "--what-if",
                     "gpus=8,bandwidth=2x,bucket_cap_mb=2", check=True)
    w = json.loads(p.stdout)["what_if"]
    asked = [s for s in w["scenarios"] if s["gpus"] == 8 and s["bandwidth_x"] == 2.0]
    assert len(asked) == 1 and asked[0]["bucket_rule"] == "cap"
    assert asked[0]["bucket_bytes"] == 2 * MIB and asked[0]["buckets"] == 2
    assert w["comm_cost"]["source"] == "measured" and w["layers_known"]
    text = run_gputrace("analyze", str(path), "--what-if", "gpus=8,bandwidth=2x", check=True)
    assert "What if" in text.stdout and "8 GPUs, measured buckets, link x2" in text.stdout
    for bad in ("gpus=0", "bandwidth=fast", "bucket=12q", "color=red"):
        e = run_gputrace("analyze", str(path), "--what-if", bad)
        assert e.returncode == 2 and len(e.stderr.strip().splitlines()) == 1, e.stderr


def _analyze_json(*argv: str) -> dict:
    return json.loads(run_gputrace("analyze", "--json", *argv, check=True, timeout=300).stdout)


def test_imported_nccl_trace_replays_link_what_ifs_and_says_buckets_cannot_be(shared_data):
    """A Kineto trace made by PyTorch's profiler on a GPU job: its NCCL units carry bytes, so
    link what-ifs replay; it has no per-layer gradients, and the bucket what-ifs say so."""
    d = _analyze_json(str(shared_data / "kineto/nccl_data.json.gz"))
    w = d["what_if"]
    assert w is not None and d["what_if_unavailable"] is None
    assert not w["layers_known"]
    assert any("bucket sizes are not replayed" in a for a in w["assumptions"])
    assert all(s["bucket_rule"] != "cap" for s in w["scenarios"])
    link = {s["bandwidth_x"]: s["t_iter"] for s in w["scenarios"]
            if s["gpus"] == d["world_size"] and s["bucket_rule"] == "measured"}
    # a faster link never predicts a slower iteration, a slower one never a faster
    assert link[2.0] <= link[1.0] <= link[0.5]


@pytest.mark.parametrize("name, why", [
    ("kineto/two_rank", "carry no byte counts"),
    ("nsys/h100_2gpu_1s.sqlite", "no gradient comm was measured"),
])
def test_imported_traces_without_replayable_comm_say_why(shared_data, name, why):
    d = _analyze_json(str(shared_data / name))
    assert d["what_if"] is None and why in d["what_if_unavailable"], d["what_if_unavailable"]
    p = run_gputrace("analyze", str(shared_data / name), check=True, timeout=300)
    said = [ln for ln in p.stdout.splitlines() if ln.startswith("What if: not replayed: ")]
    assert len(said) == 1 and why in said[0], p.stdout


def test_a_link_bandwidth_does_not_replay_comm_whose_bytes_are_unknown(shared_data):
    d = _analyze_json(str(shared_data / "kineto/two_rank"), "--link-bandwidth", "10e9")
    assert d["what_if"] is None and "no bytes to move" in d["what_if_unavailable"]


def _table_worst(kind: str) -> float:
    """The worst |error| bench/README.md's what-if table gives a kind's row (in %)."""
    readme = (Path(__file__).parents[1] / "bench" / "README.md").read_text()
    row = next(x for x in readme.splitlines() if x.startswith(f"| {kind} |"))
    return float(re.search(r"worst ([\d.]+) %", row).group(1))


def test_what_ifs_of_a_kind_measured_beyond_10_percent_carry_the_tables_band(tmp_path):
    """Bucket sizes, the link and other GPU counts were measured off by more than 10 % (bench/
    README.md's what-if table, its worst |error| per kind): each such prediction carries that
    band in --json and beside it in the terminal, never bare; the run's own configuration,
    its measurement, none."""
    path = ddp_iterations(Builder(), CASE2_UNITS).write(tmp_path / "t.arrow", world_size=2)
    w = json.loads(run_gputrace("analyze", str(path), "--json", check=True).stdout)["what_if"]
    worst = {"cap": _table_worst("DDP bucket size"), "gpus": _table_worst("GPU count"),
             "link": _table_worst("link bandwidth (DDP)")}
    assert min(worst.values()) > 10
    for s in w["scenarios"]:
        kind = "gpus" if s["gpus"] != 2 else "link" if s["bandwidth_x"] != 1 else \
            "cap" if s["bucket_rule"] != "measured" else None
        if kind is None:
            assert s["band"] is None and s["band_source"] is None, s
            continue
        assert s["band"] == pytest.approx([-worst[kind] / 100, worst[kind] / 100]), s
        assert s["band_source"] == "bench/whatif.py"
    text = run_gputrace("analyze", str(path), check=True).stdout
    grid = text[text.index("What if"):text.index("withheld")]
    row = next(x for x in grid.splitlines() if "bucket_cap_mb=1:" in x)
    # every prediction of the row, at 2 GPUs and at more, has its band beside it
    cells = re.findall(r"[\d.]+ ms\*? (±[\d.]+ %)", row)
    assert cells[0] == f"±{worst['cap']:.1f} %" and len(cells) == len(row.split(" ms")) - 1
    assert set(cells[1:]) == {f"±{worst['gpus']:.1f} %"}, row
    link = next(x for x in text.splitlines() if "link x0.5:" in x)
    assert link.endswith(f"measured error ±{worst['link']:.1f} %"), link
    assert f"measured error ±{worst['cap']:.1f} % (bench/whatif.py, bench/README.md)" in text
    # the speedup table's GPU counts: the replay's band under it (eq. 11's not measured)
    after = text[text.index("Predicted speedup"):text.index("What if")]
    assert f"the replay's measured error ±{worst['gpus']:.1f} %" in after, after
