"""`--jobs N`: N processes at work, this one among them (analysis.parallel.WithCaller over a
real pool of N - 1 spawned workers)."""

from __future__ import annotations

import os
import time

import pytest

from gputrace.analysis.parallel import executor


def _task(x: int, pause: float) -> tuple[int, int]:
    time.sleep(pause)
    if x < 0:
        raise ValueError(f"task {x}")
    return x * x, os.getpid()


def test_results_in_order_and_the_caller_takes_its_share():
    xs = list(range(12))
    with executor(2) as ex:
        out = list(ex.map(_task, xs, [0.05] * len(xs)))
    assert [r for r, _ in out] == [x * x for x in xs]
    pids = {p for _, p in out}
    assert os.getpid() in pids, "the calling process did none of the work"
    assert len(pids) == 2, f"one worker and the caller, got {len(pids)} processes"


def test_an_error_comes_in_its_turn_after_the_results_before_it():
    xs = [1, 2, -3, 4, 5]
    got = []
    with executor(2) as ex, pytest.raises(ValueError, match="task -3"):
        for r, _ in ex.map(_task, xs, [0.02] * len(xs)):
            got.append(r)
    assert got == [1, 4]


def test_one_job_is_this_process_alone():
    with executor(1) as ex:
        assert ex is None

