"""One analysis of a run, one read of its trace: what lies beside the ranks' analysis
(memory, the FLOP count, hangs) is made from what each rank's part kept as its rows were
read, in this process or in worker processes, for the rank shown and any other, with no
read of the trace once the ranks are analyzed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gputrace.analyzers
from gputrace.analysis.run import AnalysisOptions, run_analysis
from gputrace.report.document import document
from tests.tracebuilder import MS, Builder, ddp_iterations

UNITS = [([4, 3], 40, 60), ([2, 1], 70, 88)]
S = 10**9
GROUP = {"size": 2, "ranks": [0, 1], "name": "0", "desc": "default_pg"}
LAYERS = [{"layer": ly, "name": "Linear", "flops_f": 2e9, "flops_b": 4e9} for ly in (1, 2, 3, 4)]


def _row(kind: str, cat: str, name: str, t_ns: int, rank: int, *, value=None, device=-1,
         args=None) -> tuple:
    return (kind, cat, name, t_ns, None, value, "bytes" if value is not None else None, "h",
            rank, 10 + rank, 1, device, -1, -1, -1, None, None, None, None,
            json.dumps(args) if args is not None else None)


def _trace(path: Path) -> Path:
    """Two ranks of 8 DDP iterations, each with a FLOP count of its third iteration, memory
    samples at its phases' edges; NVML's used memory (the sampler's, rank -1); and rank 0
    waiting 8 s in an all-reduce that rank 1 came to last."""
    b = Builder()
    for rank in (0, 1):
        ddp_iterations(b, UNITS, n=8, rank=rank, wait=2 * rank)
        b.span("flops", 200, 300, rank=rank, step=2,
               args={"method": "FlopCounterMode", "dtype": "float32", "device": "cpu",
                     "flops_f": 8e9, "flops_b": 16e9, "model_flops": 24e9,
                     "hardware_flops": 24e9, "layers": LAYERS})
        for k, phase in enumerate(("forward", "backward", "update")):
            for edge, dt in (("start", 5), ("end", 25)):
                b.rows.append(_row("sample", "memory", "rss", (400 + 30 * k + dt) * MS, rank,
                                   value=(1 + rank + k / 10) * 2**30,
                                   args={"phase": phase, "edge": edge}))
        b.rows.append(_row("sample", "memory", "rss_peak", 500 * MS, rank, value=3 * 2**30,
                           args={"phase": "update", "edge": "end"}))
    b.rows.append(_row("sample", "gpu", "gpu.mem_used", 450 * MS, -1, value=5 * 2**30,
                       device=0))
    b.rows.append(_row("instant", "flight", "waited", 9 * S, 0, args={
        "group": GROUP, "seq": 5, "kind": "all_reduce", "entered_ns": 1 * S, "step": 3}))
    b.rows.append(_row("instant", "flight", "state", 9 * S, 1, args={
        "group": GROUP, "seq": 5, "done": 5, "in_flight": 0, "open": []}))
    return b.write_by_rank(path, world_size=2, collectors={"flops": {"status": "ok"}})


@pytest.mark.parametrize("jobs", [None, 2])
def test_what_lies_beside_the_ranks_is_read_with_them(tmp_path, monkeypatch, jobs):
    path = _trace(tmp_path / "run.arrow")
    opts = AnalysisOptions(inputs=(str(path),), jobs=jobs)
    want = {rank: document(run_analysis(opts), rank, opts.inputs) for rank in (None, 0, 1)}
    assert want[None]["memory"]["ranks"] and want[None]["memory"]["gpus"]
    assert [ly["t_b_s"] for ly in want[None]["flops"]["layers"]] == [pytest.approx(
        t / 1e3) for t in (15, 15, 15, 10)]
    assert len(want[None]["hangs"]["collectives"]) == 1

    analyze, gone = gputrace.analyzers.analyze, tmp_path / "gone.arrow"

    def then_gone(trace, **kw):
        a = analyze(trace, **kw)
        path.rename(gone)       # once the ranks are analyzed, the trace is no longer there
        return a

    monkeypatch.setattr(gputrace.analyzers, "analyze", then_gone)
    a = run_analysis(opts)
    assert gone.exists() and not path.exists()
    for rank in (None, 0, 1):
        doc = document(a, rank, opts.inputs)
        for key in ("memory", "flops", "hangs"):
            assert doc[key] == want[rank][key], (rank, key)


def test_a_glob_or_directory_of_the_trace_says_what_its_file_says(tmp_path):
    """The trace named by a glob or by its directory (as a multi-node recording's files are)
    gets the memory, FLOP count and hangs its file gets: the pass read the same rows."""
    path = _trace(tmp_path / "run.arrow")
    want = document(run_analysis(AnalysisOptions(inputs=(str(path),))), None, (str(path),))
    assert want["memory"]["ranks"] and want["hangs"]["collectives"]
    for name in (str(tmp_path / "r*.arrow"), str(tmp_path)):
        got = document(run_analysis(AnalysisOptions(inputs=(name,))), None, (name,))
        for key in ("memory", "flops", "hangs"):
            assert got[key] == want[key], (name, key)
