"""Real GPU records, replayed on any machine: the raw CUPTI records and the Kineto JSON of the
CUDA loop (tests/jobs/cuda_loop.py) as the collectors received them on a GPU, with the
loop's CUDA-event truth, under tests/data/gpu (written there by
`GPUTRACE_CAPTURE_FIXTURES=1 pytest -m gpu tests/test_gpu_truth.py -k capture` on a GPU
machine). They go through the same conversion and analysis as a live recording, and must
give what the GPU run gave: every record in a phase, each phase within 5 % of its events.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputrace.importers import kineto
from gputrace.importers.common import Rows
from gputrace.trace import load, write_trace
from gputrace.trace.schema import COLUMN_NAMES
from tests.truth import compare, matched, per_iteration, replay_cupti_dump

DATA = Path(__file__).resolve().parent / "data" / "gpu"
TERMS = {"t_h2d": ["h2d"], "t_f": ["forward"], "t_b": ["backward"], "t_u": ["update"],
         "t_iter": []}


def fixtures(pattern: str) -> list[Path]:
    return sorted(DATA.glob(pattern)) if DATA.is_dir() else []


def check(path: Path, rows: list[tuple], truth_path: Path, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "replay.arrow", {"host": "gpu", "rank": 0},
                        rows=sorted(rows, key=lambda r: r[3]))
    tr = load(trace)
    gpu = [r for r in tr.table.to_pylist() if r["cat"] in ("kernel", "memcpy", "memset")]
    assert gpu and all(r["phase"] is not None for r in gpu), path
    truth = json.loads(truth_path.read_text())
    rs = per_iteration(tr)
    compare(rs, truth, matched(rs, truth), TERMS, tol=0.05, iter_tol=0.02)


@pytest.mark.parametrize("path", fixtures("cupti_*.jsonl.gz"), ids=lambda p: p.name)
def test_cupti_records_from_a_gpu_replay_to_its_truth(path, tmp_path):
    check(path, replay_cupti_dump(path), path.with_name(path.name.replace(
        ".jsonl.gz", ".truth.json")), tmp_path)


@pytest.mark.parametrize("path", fixtures("kineto_*.json.gz"), ids=lambda p: p.name)
def test_kineto_records_from_a_gpu_replay_to_its_truth(path, tmp_path):
    ctx = json.loads(path.with_name(path.name.replace(".json.gz", ".json.context.json"))
                     .read_text())
    phases = [(tuple(p[0]), p[1], p[2], p[3]) for p in ctx["phases"]]
    iters = [tuple(i) for i in ctx["iters"]]
    threads = {v: int(k) for k, v in ctx["threads"].items()}
    out = Rows()
    kineto.read(str(path), 0, out, phases=phases, iters=iters, gpu_only=True,
                threads=threads, loops={ctx["pid"]: (ctx["pid"], ctx["loop_tid"])})
    table = out.table()
    rows = list(zip(*(table.column(c).to_pylist() for c in COLUMN_NAMES), strict=True))
    host = [("span", "iteration", "iteration", s, e, None, None, "gpu", 0, 1, ctx["loop_tid"],
             -1, -1, st, -1, None, None, None, None, None) for s, e, st in iters]
    host += [("span", c, c, s, e, None, None, "gpu", 0, 1, key[1], -1, -1, -1, -1, None,
              None, None, None, None) for key, s, e, c in phases]
    check(path, host + rows, path.with_name(path.name.replace(".json.gz", ".truth.json")),
          tmp_path)


def test_fixtures_are_small():
    total = sum(f.stat().st_size for f in fixtures("*"))
    assert total <= 2 << 20
