"""Comparing gputrace's per-iteration breakdown with a loop's own measurements (perf_counter
on the CPU, CUDA events on a GPU), iteration by iteration."""

from __future__ import annotations

import enum
import gzip
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from gputrace.analyzers.core.frame import build
from gputrace.analyzers.core.steps import RankSteps, analyze_rank
from gputrace.collectors.cupti_convert import Converter


def per_iteration(trace: Any) -> RankSteps:
    """The per-iteration breakdown of a one-rank trace."""
    (sp,) = build(trace.table, trace.metadata).ranks.values()
    return analyze_rank(sp)


def matched(rs: RankSteps, truth: list[dict[str, float]]) -> list[tuple[int, int]]:
    """Each truth step (with `start`/`end` in ns) with the analyzed iteration that overlaps
    it most: (truth index, iteration index)."""
    lo, hi = rs.iterations.start, rs.iterations.end
    pairs = []
    for i, t in enumerate(truth):
        ov = np.minimum(hi, t["end"]) - np.maximum(lo, t["start"])
        k = int(np.argmax(ov))
        if ov[k] > 0.5 * (t["end"] - t["start"]):
            pairs.append((i, k))
    return pairs


def tiled_alike(got: Any, own: Any, rel: float, floor_s: float = 0.0) -> None:
    """Iterations that tile the loop on both clocks, each within `rel` (plus `floor_s`) of
    the job's, or beside a boundary that moved: a thread switch between the job's clock read
    at an iteration's end and gputrace's (a busy neighbour makes it tens of ms) moves that
    time from one iteration into the next on one clock only, and the two together agree. A
    boundary rule that is wrong moves most boundaries: at most 2 moves (or 2 %) pass."""
    g, w = np.asarray(got, dtype=float), np.asarray(own, dtype=float)
    assert g.shape == w.shape, (g.shape, w.shape)
    tol = rel * w + floor_s
    bad = np.flatnonzero(np.abs(g - w) > tol)
    moves = int(np.sum(np.diff(bad) != 1)) + 1 if bad.size else 0
    assert moves <= max(2, g.size // 50), (bad.tolist(), g.round(5).tolist(), w.round(5).tolist())
    for i in bad.tolist():
        assert any(abs(g[i] + g[j] - w[i] - w[j]) <= tol[i] + tol[j]
                   for j in (i - 1, i + 1) if 0 <= j < g.size), \
            (i, g.round(5).tolist(), w.round(5).tolist())


def compare(rs: RankSteps, truth: list[dict[str, float]], pairs: list[tuple[int, int]],
            terms: dict[str, list[str]], tol: float, iter_tol: float = 0.05,
            skip: int = 3) -> dict[str, tuple[float, float]]:
    """Iteration by iteration, warm-up (`skip`) left out: gputrace's figure over the loop's
    own (the sum of the truth keys given; `t_iter`: the loop's own iteration). The median
    ratio is held to the tolerance: both clocks see a preemption inside a phase the same,
    one at its edge (machines here are shared) moves a single iteration, not the run.
    `t_iter` is held as the matched iterations' total: the iterations tile the loop on both
    clocks, whose boundaries may be drawn at other points of it, so what runs between the
    two (a preemption there beside a busy neighbour) is in one iteration on one clock and
    the next on the other: it moves single iterations' ratios (0.87 and 1.06 for one
    neighbouring pair of a TensorFlow loop beside the suite's other workers, whose median
    of 8 was 1.058 and total 1.009), not the time they take together. The loop's own
    iterations are taken less what gputrace did between two of its iterations (TensorFlow's
    profiler stopped after a window: 130 ms beside two CPU hogs, in the loop's iteration).
    Returns term -> (gputrace's mean, the loop's mean)."""
    pairs = pairs[skip:]
    assert len(pairs) >= 8, pairs
    gaps = _between(rs)
    out = {}
    for term, keys in terms.items():
        got = np.array([rs.terms[term][k] for _, k in pairs])
        want = np.array([_loop_s(truth[i], gaps) if term == "t_iter"
                         else sum(truth[i][x] for x in keys) for i, _ in pairs])
        rel = iter_tol if term == "t_iter" else tol
        ratio = float(got.sum() / want.sum() if term == "t_iter" else np.median(got / want))
        assert abs(ratio - 1) <= rel, (term, ratio, got.tolist(), want.tolist())
        out[term] = (float(np.mean(got)), float(np.mean(want)))
    return out


def _between(rs: RankSteps) -> list[tuple[int, int]]:
    """What lies between two of gputrace's consecutive iterations, in neither: its own work
    at a step boundary (TensorFlow's profiler started or stopped there, outside both:
    collectors/tensorflow.py); the job's clock holds it. Torch's iterations leave none."""
    st, en = rs.iterations.start, rs.iterations.end
    return [(int(en[k]), int(st[k + 1])) for k in range(len(st) - 1) if st[k + 1] > en[k]]


def _loop_s(it: dict[str, float], gaps: list[tuple[int, int]]) -> float:
    """The loop's own iteration less what gputrace did in it between its iterations."""
    lo, hi = it["start"], it["end"]
    return (hi - lo - sum(max(0, min(hi, b) - max(lo, a)) for a, b in gaps)) / 1e9


def span_rows(spans: list[list[Any]], host: str = "gpu") -> list[tuple[Any, ...]]:
    """Trace rows of the recorder's span tuples (cat, name, start, end, tid, step, layer,
    bytes, args)."""
    return [("span", c, n, s, e, None, None, host, 0, 1, tid, -1, -1, st, ly, b, None, None,
             None, a) for c, n, s, e, tid, st, ly, b, a in spans]


def replay_cupti_dump(path: Path) -> list[tuple[Any, ...]]:
    """A GPUTRACE_CUPTI_DUMP file through the CUPTI collector's conversion, flush by flush
    as it was recorded (the enums' values as the dumping cupti module had them): the host's
    span rows and the converted GPU rows."""
    lines = [json.loads(x) for x in gzip.open(path, "rt")]
    head = lines[0]
    cu = SimpleNamespace(**{name: enum.IntEnum(name, values)
                            for name, values in head["enums"].items()})
    threads: dict[int, int] = {}
    conv = Converter(cu, host="gpu", rank=0, pid=1, offset_ns=head["clock_offset_ns"],
                     threads=threads)
    spans: list[list[Any]] = []
    rows: list[tuple[Any, ...]] = []
    for ln in lines[1:]:
        threads.update({int(k): v for k, v in ln["threads"].items()})
        conv.add_spans([tuple(s) for s in ln["spans"]])
        spans += ln["spans"]
        for b in ln["batches"]:
            conv.feed([SimpleNamespace(**r) for r in b])
        rows += conv.drain(ln["final"])
    return span_rows(spans) + rows
