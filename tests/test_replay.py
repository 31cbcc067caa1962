"""What-if replay: the pieces against hand-computed answers, then whole hand-built traces
(Case 2 DDP, comm after backward), then the command line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gputrace.analyzers.replay import MIB, CommCost, Scenario, buckets_by_cap, fit_cost, simulate
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


def test_case2_trace_replays_to_the_hand_computed_timeline(tmp_path):
    # backward ends: layer 4 at 40 ms, 3 at 55, 2 at 70, 1 at 85; units of 1 MB each take
    # 22, 10, 12 and 7 ms on the link (51 ms for 4 MB: 12.75 ms per unit)
    a = run_analysis(tmp_path, ddp_iterations(Builder(), CASE2_UNITS, update=(92, 98)),
                     skip=1, world_size=2, gpus=(4,),
                     what_if=[Scenario(0, 1.0, 2 * MIB)])
    rp = a.main.replay
    assert rp.cost.alpha_s == 0 and rp.cost.beta_bytes_per_s == pytest.approx(4e6 / 0.051)
    assert rp.backward_end_s == pytest.approx(85 * MS)
    # serial replay: 40-52.75, 55-67.75, 70-82.75, 85-97.75; measured tail ends at 92
    assert rp.baseline_t_iter == pytest.approx((100 - 92 + 97.75) * MS)
    t = {o.scenario: o for o in rp.outcomes}
    assert t[Scenario(2)].t_iter == pytest.approx(100 * MS)
    # one GPU: the measured iteration without its measured comm tail past backward (85 to
    # 92 ms), as eq. 8-11 count it: 93 ms
    assert t[Scenario(2)].speedup == pytest.approx(2 * 93 / 100)
    assert t[Scenario(4)].t_iter == pytest.approx((100 - 97.75 + 116.5) * MS)
    assert t[Scenario(2, 2.0)].t_iter == pytest.approx((100 - 97.75 + 91.375) * MS)
    # 2 MiB buckets: layers 4+3+2 (3 MB, ready at 70 ms: 70-108.25), then layer 1 (-121)
    b = t[Scenario(2, 1.0, 2 * MIB)]
    assert b.buckets == 2 and b.t_iter == pytest.approx((100 - 97.75 + 121) * MS)
    assert t[Scenario(2, 1.0, math.inf)].buckets == 1


def test_comm_after_backward_merging_units_saves_their_latency(tmp_path):
    units = [([4], 85, 88), ([3], 88, 91), ([2, 1], 91, 96)]
    a = run_analysis(tmp_path, ddp_iterations(Builder(), units, update=(96, 99)), skip=1,
                     world_size=2)
    m, rp = a.main.model, a.main.replay
    assert m.strategy == "sequential"
    # 1 MB in 3 ms, 2 MB in 5 ms: 1 ms + 2 ms per MB
    assert rp.cost.alpha_s == pytest.approx(1 * MS)
    assert rp.cost.beta_bytes_per_s == pytest.approx(1e6 / (2 * MS))
    assert rp.baseline_error == pytest.approx(0, abs=1e-9)
    one = next(o for o in rp.outcomes if o.scenario == Scenario(2, 1.0, math.inf))
    # all 4 MB at once when backward ends at 85: 1 + 8 ms -> 94 instead of 96
    assert one.buckets == 1 and one.t_iter == pytest.approx(98 * MS)


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
    # 25 MiB buckets hold both layers (20 MB, ready at 80 ms): 2*7/8 * 20 MB / 1 GB/s = 35 ms
    assert o[Scenario(8)].buckets == 1
    assert o[Scenario(8)].t_iter == pytest.approx(0.100 + 0.035)
    # 1 MiB buckets: layer 2 at 60 ms (17.5 ms, to 77.5), layer 1 at 80 ms (to 97.5)
    assert o[Scenario(8, 1.0, MIB)].t_iter == pytest.approx(0.100 + 0.0175)
    assert o[Scenario(8)].speedup == pytest.approx(8 * 0.100 / 0.135)


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
