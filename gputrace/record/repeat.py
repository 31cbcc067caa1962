"""`gputrace record --repeat N`: one command recorded N times, or two interleaved (A B, B A,
A B, ...) so that what the machine does meanwhile falls on both, each run in its own numbered trace
(`base.arrow` -> `base-1.arrow`, `base-2.arrow`, ...), what `gputrace diff` takes as the
runs of a side (`diff 'base-*.arrow' 'new-*.arrow'`)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from gputrace.record.runner import RecordOptions, RecordResult, record


def numbered(output: str, i: int) -> str:
    """The trace of the `i`-th run (from 1): `run.arrow` -> `run-1.arrow`."""
    stem, ext = os.path.splitext(output)
    return f"{stem}-{i}{ext or '.arrow'}"


def plan(sides: list[RecordOptions], n: int) -> list[RecordOptions]:
    """The runs in the order they are made: round by round, each side once a round, the
    second round in the other order (A B, B A, A B, ...): each round a pair of runs next to
    each other in time, and neither command always the first of its pair."""
    return [replace(o, output=numbered(o.output, i)) for i in range(1, n + 1)
            for o in (sides if i % 2 else sides[::-1])]


def repeat(sides: list[RecordOptions], n: int) -> list[RecordResult]:
    """Record each of `sides` `n` times, interleaved; stop at the first run whose job
    fails (its result last), saying which."""
    out: list[RecordResult] = []
    runs = plan(sides, n)
    for k, o in enumerate(runs, 1):
        if not o.quiet:
            print(f"gputrace: run {k} of {len(runs)}: {o.output}", file=sys.stderr)
        res = record(o)
        out.append(res)
        if res.exit_code != 0:
            print(f"gputrace: run {k} of {len(runs)} ({o.output}) exited {res.exit_code}; "
                  "the runs after it were not made", file=sys.stderr)
            break
    return out
