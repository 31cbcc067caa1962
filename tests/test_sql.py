"""SQL over a trace (gputrace.sql, DuckDB): one file, a multi-node set of parts and a shard
directory give the same rows; each ready query's rows are checked against the trace's own
rows, computed here with pyarrow and plain Python."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow.compute as pc
import pytest

from bench.synth import write_arrow, write_nodes
from gputrace.trace import load
from tests.tracebuilder import Builder, ddp_iterations

duckdb = pytest.importorskip("duckdb", reason="the notebook extra (duckdb) is not installed")
from gputrace import sql  # noqa: E402

EVENTS = 20_000


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, list[str]]:
    """The same 8 ranks as one file, as the files of a 2-node recording (named by the
    recording's name) and as a directory of per-rank shards."""
    d = tmp_path_factory.mktemp("sql")
    write_arrow(d / "one.arrow", EVENTS, ranks=8)
    write_nodes(d / "nodes", EVENTS, ranks=8, per_node=4)
    (d / "shards").mkdir()
    write_arrow(d / "shards", EVENTS, ranks=8, shards=True)
    return {"file": [str(d / "one.arrow")], "nodes": [str(d / "nodes" / "run.arrow")],
            "shards": [str(d / "shards")]}


def own_rows(paths: list[str]) -> list[dict]:
    t = load(*paths).table if not paths[0].endswith("run.arrow") else \
        load(*sorted(str(p) for p in Path(paths[0]).parent.glob("run.*.arrow"))).table
    return t.to_pylist()


def top_kernels(rows: list[dict]) -> list[tuple]:
    per: dict[tuple, list[int]] = defaultdict(list)
    for r in rows:
        if r["kind"] == "span" and r["cat"] in ("kernel", "memcpy", "memset"):
            per[(r["phase"] or "none", r["name"])].append(r["end_ns"] - r["start_ns"])
    out = []
    for phase in sorted({p for p, _ in per}):
        mine = sorted(((sum(v), n) for (p, n), v in per.items() if p == phase),
                      key=lambda x: (-x[0], x[1]))[:5]
        out += [(phase, n, len(per[(phase, n)]), s / 1e9) for s, n in mine]
    return out


@pytest.mark.parametrize("layout", ["file", "nodes", "shards"])
def test_layouts_and_top_kernels_per_phase(layouts, layout):
    rows = own_rows(layouts[layout])
    con = sql.connect(layouts[layout])
    assert con.sql("SELECT count(*) FROM events").fetchall()[0][0] == len(rows)
    assert con.sql("SELECT count(DISTINCT rank) FROM iterations").fetchall()[0][0] == 8
    got = [(p, n, c, pytest.approx(s, rel=1e-12)) for p, n, c, s, _ in
           con.sql(sql.QUERIES["top_kernels"]).fetchall()]
    want = top_kernels(rows)
    assert {p for p, *_ in want} >= {"forward", "backward", "update"}
    assert got == want


def test_comm_per_kind_and_group_and_slow_iterations(tmp_path):
    """Rank 1's step 3 lasts 150 ms against a median of 100 ms; the job issued all-gathers
    on group 'tp' and one broadcast on the default group beside DDP's buckets."""
    b = ddp_iterations(Builder(), [([2, 1], 85, 92)], n=6)
    start = 0
    for k in range(6):
        length = 150 if k == 3 else 100
        b.span("iteration", start, start + length, step=k, rank=1)
        start += length
    for k in range(6):
        for rank in (0, 1):
            b.span("comm", k * 100 + 6, k * 100 + 8, name="all_gather", rank=rank, step=k,
                   nbytes=4096)
            b.rows[-1] = (*b.rows[-1][:-1], json.dumps(
                {"kind": "all_gather", "group": {"name": "tp", "size": 2, "ranks": [0, 1]}}))
    b.span("comm", 1, 2, name="broadcast", rank=0, nbytes=100)
    b.rows[-1] = (*b.rows[-1][:-1], json.dumps({"kind": "broadcast",
                                                "group": {"name": "0", "size": 2}}))
    path = b.write(tmp_path / "t.arrow")
    t = load(path).table
    comm = t.filter(pc.equal(t.column("cat"), "comm")).to_pylist()
    want: dict[tuple, list] = defaultdict(lambda: [0, 0, 0])
    for r in comm:
        a = json.loads(r["args"])
        kind = a.get("kind") or ("all_reduce" if r["name"] == "allreduce" else r["name"])
        key = (kind, (a.get("group") or {}).get("name"))
        want[key][0] += 1
        want[key][1] += r["bytes"]
        want[key][2] += r["end_ns"] - r["start_ns"]
    got = {(k, g): [n, nb, pytest.approx(s * 1e9)] for k, g, n, nb, s, _ in
           sql.query(path, "comm_by_kind").fetchall()}
    assert got == {k: v for k, v in want.items()}
    assert set(got) == {("all_reduce", None), ("all_gather", "tp"), ("broadcast", "0")}
    slow = sql.query(path, "slow_iterations").fetchall()
    assert slow == [(1, 3, pytest.approx(0.150), pytest.approx(1.5))]


@pytest.mark.slow
def test_imported_kineto_trace(shared_data):
    src = str(shared_data / "kineto" / "two_rank")
    from gputrace.cli import load_trace

    rows = load_trace([src]).table
    con = sql.connect(src)
    assert con.sql("SELECT count(*) FROM events").fetchall()[0][0] == rows.num_rows
    n_comm = pc.sum(pc.equal(rows.column("cat"), "comm")).as_py()
    assert sum(r[2] for r in con.sql(sql.QUERIES["comm_by_kind"]).fetchall()) == n_comm
    ranks = sorted(set(rows.column("rank").to_pylist()) - {-1})
    its = con.sql("SELECT rank, count(*) FROM iterations GROUP BY 1 ORDER BY 1").fetchall()
    assert [r for r, _ in its] == ranks


def test_bad_input_is_one_line(tmp_path):
    from gputrace.api import AnalysisError

    with pytest.raises(AnalysisError, match="missing.arrow"):
        sql.connect(tmp_path / "missing.arrow")
