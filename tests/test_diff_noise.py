"""The interval of a change between two runs (gputrace.analyzers.compare.diff_noise), on iteration
series made here with known stalls and known changes: a run whose machine preempted it in
some iterations against a run that was not is within noise; a change made in every
iteration is beyond it, stalls or not; the excursions are the stalls put in; the job's
wait for a CPU behind its own processes is not the machine's load."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from gputrace.analyzers.compare.diff_noise import (
    Noise,
    excursions,
    interval,
    iteration_excursions,
    net_of_wait,
)
from gputrace.analyzers.compare.diff_parts import parts

N = 17          # the analyzed iterations of a 20-step recording


def run(seed: int, stalled: int = 0, stall_s: float = 4e-3, extra_s: float = 0.0
        ) -> dict[str, np.ndarray]:
    """One run's terms: a forward of 2-14 ms (a data-dependent cost), a backward of
    0.6 ms +- 5 % plus `extra_s`, and a stall of `stall_s` in the backward of `stalled`
    iterations (which ones drawn with `seed`)."""
    rng = np.random.default_rng(seed)
    t_f = 2e-3 + 12e-3 * rng.random(N)
    t_b = 0.6e-3 * (1 + 0.05 * rng.standard_normal(N)) + extra_s
    hit = rng.choice(N, stalled, replace=False)
    t_b[hit] += stall_s
    return {"t_f": t_f, "t_b": t_b, "t_iter": t_f + t_b, "hit": np.sort(hit)}


def test_excursions_are_the_stalls_put_in():
    r = run(1, stalled=5)
    ex = excursions(r["t_b"])
    assert list(np.flatnonzero(ex)) == list(r["hit"])
    # each one the stall less the fence's height above that iteration's own backward
    # (3.5 robust deviations of 5 % of 0.6 ms, and the spread: under 0.3 ms of 4 ms)
    assert ex[r["hit"]] == pytest.approx(np.full(5, 4e-3), abs=3e-4)
    # the iteration's own spread (the forward's 2-14 ms) hides them; its terms do not
    assert not excursions(r["t_iter"]).any()
    it = iteration_excursions(r, ("t_f", "t_b"))
    assert list(np.flatnonzero(it)) == list(r["hit"])
    # a change in every iteration is no excursion
    assert not excursions(run(1, extra_s=8e-3)["t_b"]).any()


def test_a_run_stalled_in_half_its_iterations_against_one_not_is_within_noise():
    """The same job twice: one recording had 4 ms stalls in 8 of its 17 iterations (a
    loaded machine), the other none. Resampling the iterations alone calls that beyond
    noise; with the between-run term it is within, the term being the stall time per
    iteration."""
    before, after = run(2, stalled=8), run(3)
    ex = [iteration_excursions(r, ("t_f", "t_b")) for r in (before, after)]
    alone = interval(before["t_b"], after["t_b"], ex_x=np.zeros(N), ex_y=np.zeros(N))
    assert alone.high < 0                                  # what the iterations alone say
    ci = interval(before["t_iter"], after["t_iter"], ex_x=ex[0], ex_y=ex[1])
    assert ci.low < np.mean(after["t_iter"]) - np.mean(before["t_iter"]) < ci.high
    assert ci.low < 0 < ci.high
    # the stall time per iteration, less the fence's height above the typical backward
    # (with 8 of 17 stalled, the median deviation is the largest unstalled one's)
    assert ci.between_s == pytest.approx(8 * 4e-3 / N, rel=0.15)
    b = interval(before["t_b"], after["t_b"])
    assert b.low < 0 < b.high


@pytest.mark.parametrize("extra_ms", [2.0, 8.0])
def test_a_change_in_every_iteration_is_beyond_noise_beside_stalls(extra_ms):
    """A backward slowed by 2 or 8 ms in every iteration, both runs stalled in 2 of their
    iterations: beyond noise, the interval holding the change made."""
    before, after = run(4, stalled=2), run(5, stalled=2, extra_s=extra_ms / 1e3)
    ex = [iteration_excursions(r, ("t_f", "t_b")) for r in (before, after)]
    b = interval(before["t_b"], after["t_b"])
    assert b.low > 0 and b.low < extra_ms / 1e3 < b.high
    if extra_ms == 8.0:      # the iteration's own spread is 12 ms: only a large change shows
        ci = interval(before["t_iter"], after["t_iter"], ex_x=ex[0], ex_y=ex[1])
        assert ci.low > 0


def test_the_same_run_on_both_sides_holds_zero_and_is_reproducible():
    r = run(6, stalled=3)
    ci = interval(r["t_iter"], r["t_iter"])
    assert ci.low < 0 < ci.high and ci == interval(r["t_iter"], r["t_iter"])
    assert interval(r["t_b"][:1], r["t_b"]) is None        # one iteration: no interval


def test_a_run_slowed_throughout_by_the_machine_is_within_noise_by_its_measured_wait():
    """A run 5 ms slower in every iteration: beyond noise as a change the job made (the
    same run-queue wait in both), within noise where the recording measured 5 ms more wait
    per iteration (the machine kept the job from a CPU); and a change made by the job on a
    machine loaded alike in both runs (the same share of each iteration waiting) stays
    beyond noise."""
    before = run(7)
    after = {k: v + 5e-3 for k, v in run(7).items() if k != "hit"}
    tx, ty = float(np.mean(before["t_iter"])), float(np.mean(after["t_iter"]))
    ci = interval(before["t_iter"], after["t_iter"])
    assert ci.low > 0
    same = net_of_wait(ci, tx, ty, 1e-3, 1e-3)
    assert same.low == ci.low > 0
    waited = net_of_wait(ci, tx, ty, 1e-3, 6e-3)
    assert waited.low < 0 < waited.high and waited.high == ci.high
    assert net_of_wait(ci, tx, ty, None, 6e-3) == ci        # not recorded on a side
    # both runs waited half of each iteration: the job's own change, at the same load
    loaded = net_of_wait(ci, tx, ty, tx / 2, ty / 2)
    assert loaded.low == pytest.approx(ci.low) and loaded.high == pytest.approx(ci.high)
    assert loaded.low > 0


def samples(tree_cpus: float, wait_per_s: float, host_pct: float = 100.0) -> pa.Table:
    """One host's samples over 2 s, every 20 ms, as the host collector writes them: the host's
    busy share of its CPUs (`cpu.percent`), the traced tree's CPU (`proc.cpu_percent`, % of
    one CPU) and its run-queue wait (`proc.run_wait_s`, cumulative)."""
    at = np.arange(0, 2_000_000_000, 20_000_000)
    rows = {"cpu.percent": np.full(at.size, host_pct),
            "proc.cpu_percent": np.full(at.size, 100 * tree_cpus),
            "proc.run_wait_s": at / 1e9 * wait_per_s}
    names = [n for n in rows for _ in at]
    return pa.table({"cat": ["cpu"] * len(names), "name": names,
                     "start_ns": np.tile(at, 3), "end_ns": np.tile(at, 3),
                     "rank": [-1] * len(names), "layer": [-1] * len(names),
                     "device": [-1] * len(names), "host": ["h"] * len(names),
                     "value": np.concatenate(list(rows.values()))})


def test_the_jobs_own_cpu_demand_is_not_counted_as_noise():
    """num_workers 0 -> 2 on a 2-CPU host kept busy: the loop's own clock +8.2 ms, its wait
    for a CPU 0.58 -> 11.2 ms per iteration. Before, the job's one process took one CPU of
    the two busy: it waited behind the others only (all its wait the load); after, it and
    its workers took 1.9: 0.9 of their own beside the others' 0.1 (the load's share: 10 %).
    The load's wait is the others' share only: the change stays beyond noise; counted
    whole (as where the CPUs are not recorded), it was within."""
    starts = np.arange(10) * 100_000_000 + 500_000_000       # 10 iterations of 100 ms
    end = int(starts[-1]) + 100_000_000
    before = parts(samples(1.0, 0.58e-3 / 0.1), 0, starts, end, cpus=2)
    after = parts(samples(1.9, 11.2e-3 / 0.1), 0, starts, end, cpus=2)
    assert before.run_wait_s + before.own_wait_s == pytest.approx(0.58e-3)
    assert after.run_wait_s + after.own_wait_s == pytest.approx(11.2e-3)
    assert before.run_wait_s == pytest.approx(0.58e-3)        # all the others'
    assert after.run_wait_s == pytest.approx(1.12e-3)         # the others' 10 %
    ci = Noise(5.0e-3, 11.0e-3, 0.0)                          # the iterations' own interval
    tx, ty = 100e-3, 108.2e-3
    net = net_of_wait(ci, tx, ty, before.run_wait_s, after.run_wait_s)
    assert net.low > 0                                        # the job's change, beyond noise
    whole = net_of_wait(ci, tx, ty, 0.58e-3, 11.2e-3)
    assert whole.low < 0 < whole.high
    unknown = parts(samples(1.9, 11.2e-3 / 0.1), 0, starts, end, cpus=None)
    assert unknown.run_wait_s == pytest.approx(11.2e-3) and unknown.own_wait_s is None
