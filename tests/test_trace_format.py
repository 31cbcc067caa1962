"""Trace format v1: round trip, truncation recovery, shards, versions."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from gputrace.trace import TraceFormatError, TraceWriter, load
from gputrace.trace.schema import COLUMN_NAMES, METADATA_KEY, schema


def span_row(i: int, cat: str = "forward", rank: int = 0) -> tuple:
    return ("span", cat, f"layer{i % 7}", 1_000 + i * 10, 1_005 + i * 10, None, None, "h", rank,
            42, 7, -1, -1, i // 10, i % 5, i * 3 if i % 2 else None, None, None, None,
            json.dumps({"layers": [i]}) if i % 3 == 0 else None,
            ("forward", "backward")[i % 2] if i % 4 < 2 else None)


def sample_row(i: int) -> tuple:
    return ("sample", "host", "proc.read_bytes", 2_000 + i, None, float(i * 4096), "bytes", "h",
            -1, 1, -1, -1, -1, -1, -1, None, None, None, None, None, None)


def test_schema_matches_design_columns():
    s = schema({})
    # DESIGN's v1 columns first, in order; extensions only after them
    assert s.names[:20] == ["kind", "cat", "name", "start_ns", "end_ns", "value", "unit",
                            "host", "rank", "pid", "tid", "device", "stream", "step", "layer",
                            "bytes", "src_kind", "dst_kind", "corr", "args"]
    assert s.names[20:] == ["phase", "launch_ns"]
    assert pa.types.is_dictionary(s.field("kind").type)
    assert s.field("start_ns").type == pa.int64()
    assert s.field("device").type == pa.int16()
    md = json.loads(s.metadata[METADATA_KEY])
    assert md["format"] == "gputrace-trace" and md["version"] == 1


def test_round_trip_with_many_batches_and_growing_dictionaries(tmp_path):
    path = tmp_path / "t.arrow"
    rows = [span_row(i) for i in range(300)] + [sample_row(i) for i in range(50)]
    rows[40:77] = [span_row(40)] * 37   # a batch with one value throughout every column
    w = TraceWriter(path, {"host": "h", "rank": 0})
    for k in range(0, len(rows), 37):  # new names keep appearing across batches
        w.write_rows(rows[k:k + 37])
    w.close()
    tr = load(path)
    assert tr.metadata["rank"] == 0
    got = [tuple(r[c] for c in COLUMN_NAMES) for r in tr.table.to_pylist()]
    # rows shorter than the schema take nulls for the extensions they do not give
    assert got == [r + (None,) * (len(COLUMN_NAMES) - len(r)) for r in rows]
    assert not tr.warnings


def test_compressed_and_dictionary_encoded(tmp_path):
    path = tmp_path / "t.arrow"
    w = TraceWriter(path, {})
    w.write_rows([span_row(i) for i in range(20000)])
    w.close()
    raw = 20000 * 8 * 8  # eight int64-sized columns alone, uncompressed
    assert os.path.getsize(path) < raw / 4
    with pa.ipc.open_file(str(path)) as rd:
        assert pa.types.is_dictionary(rd.schema.field("name").type)


def test_truncated_file_recovers_every_complete_batch(tmp_path):
    path = tmp_path / "t.arrow"
    w = TraceWriter(path, {"host": "h"})
    sizes = []
    for b in range(8):
        w.write_rows([span_row(b * 100 + i) for i in range(100)])
        sizes.append(os.path.getsize(path))  # file size after each complete batch
    w.close()
    data = path.read_bytes()
    cut_path = tmp_path / "cut.arrow"
    offsets = sorted(set(range(sizes[0] - 50, len(data), 97)) | set(sizes) | {len(data) - 1})
    for off in offsets:
        cut_path.write_bytes(data[:off])
        tr = load(cut_path)
        complete = sum(1 for s in sizes if s <= off)
        assert tr.num_rows == complete * 100, off
        assert tr.table.column("start_ns").to_pylist() == \
            [span_row(i)[3] for i in range(complete * 100)]
        assert tr.warnings and "recovered" in tr.warnings[0]


def test_truncated_before_schema_is_a_clear_error(tmp_path):
    path = tmp_path / "t.arrow"
    w = TraceWriter(path, {})
    w.write_rows([span_row(1)])
    w.close()
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(path.read_bytes()[:12])
    with pytest.raises(TraceFormatError, match="truncated before its schema"):
        load(cut)


def test_directory_of_shards_reads_as_one_table(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    for r in range(3):
        w = TraceWriter(d / f"s{r}.arrow", {"host": "h", "rank": r, "role": "process"})
        w.write_rows([span_row(i, rank=r) for i in range(10 * (r + 1))])
        w.close()
    (d / "notes.txt").write_text("ignored")
    tr = load(d)
    assert tr.num_rows == 10 + 20 + 30
    assert sorted(set(tr.table.column("rank").to_pylist())) == [0, 1, 2]
    assert tr.metadata["ranks"] == [0, 1, 2]
    assert len(tr.metadata["shards"]) == 3


def test_newer_major_version_is_refused(tmp_path):
    s = schema({}).with_metadata({METADATA_KEY: json.dumps(
        {"format": "gputrace-trace", "version": 2}).encode()})
    path = tmp_path / "v2.arrow"
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, s) as w:
        w.write_table(s.empty_table())
    with pytest.raises(TraceFormatError, match="version 2 is newer"):
        load(path)


def test_not_a_trace_is_refused(tmp_path):
    p = tmp_path / "x.arrow"
    p.write_bytes(b"hello world, not arrow")
    with pytest.raises(TraceFormatError, match="not an Arrow IPC file"):
        load(p)
    t = pa.table({"a": [1]})
    with pa.OSFile(str(p), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
        w.write_table(t)
    with pytest.raises(TraceFormatError, match="no 'gputrace' schema metadata"):
        load(p)


def test_unknown_extra_columns_are_kept_and_missing_ones_defaulted(tmp_path):
    # an older/other writer: fewer columns, plus one this version does not know
    md = {METADATA_KEY: json.dumps({"format": "gputrace-trace", "version": 1}).encode()}
    t = pa.table({"kind": ["span"], "cat": ["forward"], "name": ["f"], "start_ns": [5],
                  "end_ns": [9], "future_col": [1.5]}).replace_schema_metadata(md)
    p = tmp_path / "old.arrow"
    with pa.OSFile(str(p), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
        w.write_table(t)
    tr = load(p)
    n = len(COLUMN_NAMES)
    assert tr.table.column_names[:n] == COLUMN_NAMES
    assert tr.table.column("future_col").to_pylist() == [1.5]
    row = tr.table.to_pylist()[0]
    assert row["rank"] == -1 and row["layer"] == -1 and row["bytes"] is None


def test_merge_skips_a_shard_killed_before_its_schema(tmp_path):
    from gputrace.record.merge import merge_shards
    from tests.tracebuilder import Builder

    d = tmp_path / "shards"
    d.mkdir()
    Builder().span("forward", 0, 1).span("backward", 1, 2).write(d / "a.arrow")
    (d / "b.arrow").write_bytes(b"ARROW1\x00\x00\xff\xff")   # SIGKILL during the header
    r = merge_shards(str(d), str(tmp_path / "m.arrow"))
    assert r.rows == 2 and any("b.arrow: skipped" in w for w in r.warnings)
    assert load(tmp_path / "m.arrow").num_rows == 2


def test_rank_at_a_time_reads_every_column_and_analyzes_like_the_whole(tmp_path):
    from gputrace.analyzers import analyze
    from gputrace.report.json import to_dict
    from gputrace.trace.ranked import open_by_rank
    from gputrace.trace.writer import write_by_rank
    from tests.tracebuilder import Builder, ddp_iterations

    b = Builder()
    for r in range(3):
        ddp_iterations(b, [((4, 3), 42, 60), ((2, 1), 72, 88)], rank=r, shift=r * 0.5)
    for i in range(20):
        b.sample("proc.read_bytes", i * 30, i * 4096)
    whole = load(b.write(tmp_path / "mixed.arrow"))
    p = tmp_path / "by_rank.arrow"
    write_by_rank(p, whole.metadata, whole.table)
    ranked = open_by_rank(p)
    assert ranked is not None and ranked.ranks == [-1, 0, 1, 2]
    t = load(p).table
    for r in ranked.ranks:
        want = t.filter(pa.compute.equal(t.column("rank"), r))
        cols = ranked.columns(r)
        for c in COLUMN_NAMES:   # popped in schema order, read two at a time
            assert cols.pop(c).to_pylist() == want.column(c).to_pylist(), (r, c)
        assert len(cols) == 0 and ranked.rows[r] == want.num_rows
    assert to_dict(analyze(open_by_rank(p))) == to_dict(analyze(load(p)))


def test_rank_at_a_time_defaults_columns_an_older_file_lacks(tmp_path):
    from gputrace.analyzers import analyze
    from gputrace.trace.ranked import open_by_rank

    md = {METADATA_KEY: json.dumps({"format": "gputrace-trace", "version": 1}).encode()}
    p = tmp_path / "old.arrow"
    sch = pa.schema([("kind", pa.string()), ("cat", pa.string()), ("name", pa.string()),
                     ("start_ns", pa.int64()), ("end_ns", pa.int64()), ("rank", pa.int32())],
                    metadata=md)
    with pa.OSFile(str(p), "wb") as f, pa.ipc.new_file(f, sch) as w:
        for r in (0, 1):
            w.write_table(pa.table({"kind": ["span"] * 2, "cat": ["iteration", "forward"],
                                    "name": ["it", "f"], "start_ns": [0, 10],
                                    "end_ns": [100, 60], "rank": [r, r]}, schema=sch))
    ranked = open_by_rank(p)
    assert ranked is not None and ranked.ranks == [0, 1]
    cols = ranked.columns(1)
    assert cols.pop("cat").to_pylist() == ["iteration", "forward"]
    assert cols.pop("layer").to_pylist() == [-1, -1]       # missing: the v1 default
    assert cols.pop("phase").to_pylist() == [None, None]
    a = analyze(open_by_rank(p))
    assert sorted(a.ranks) == [0, 1]
    assert a.ranks[1].breakdown["t_f"].mean == pytest.approx(50e-9)


def test_merge_takes_each_rank_from_every_shard_that_holds_it_sorted_and_loses_nothing(tmp_path):
    from gputrace.record.merge import merge_shards
    from gputrace.trace.ranked import open_by_rank
    from tests.tracebuilder import Builder

    d = tmp_path / "shards"
    d.mkdir()
    a, b, rec = Builder(), Builder(), Builder()
    for k in range(5):   # rank 0's process and rank 1's, interleaved in time
        a.span("forward", 10 * k + 1, 10 * k + 4, rank=0, pid=10)
        b.span("forward", 10 * k + 2, 10 * k + 6, rank=1, pid=11)
        rec.sample("proc.read_bytes", 10 * k, k * 4096.0)   # the recording process: rank -1
    rec.span("io", 3, 5, rank=0, pid=12)   # a loader worker's row in the recorder's shard
    a.write(d / "a.arrow", rank=0)
    b.write(d / "b.arrow", rank=1)
    rec.write(d / "rec.arrow", role="record")
    md = {METADATA_KEY: json.dumps({"format": "gputrace-trace", "version": 1}).encode()}
    old = pa.table({"kind": ["span"], "cat": ["user"], "name": ["x"], "start_ns": [7]}
                   ).replace_schema_metadata(md)
    with pa.OSFile(str(d / "old.arrow"), "wb") as f, pa.ipc.new_file(f, old.schema) as w:
        w.write_table(old)    # a file with no rank column: its row is rank -1's
    whole = load(d)
    r = merge_shards(str(d), str(tmp_path / "m.arrow"))
    assert r.rows == whole.num_rows == 17 and r.shards == 4
    assert r.rows_by_cat == {"forward": 10, "host": 5, "io": 1, "user": 1}
    merged = load(tmp_path / "m.arrow").table
    keys = list(zip(merged.column("rank").to_pylist(), merged.column("start_ns").to_pylist(),
                    strict=True))
    assert keys == sorted(keys)
    assert sorted(merged.to_pylist(), key=str) == sorted(whole.table.to_pylist(), key=str)
    ranked = open_by_rank(tmp_path / "m.arrow")
    assert ranked is not None and ranked.rows == {-1: 6, 0: 6, 1: 5}
    assert not d.exists()


def test_no_test_job_shadows_a_standard_library_module():
    """Job scripts the tests write land first on their job's sys.path: one named like a
    standard-library module (a `copy.py` did) breaks the job's imports on a GPU machine."""
    import re
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    names = set()
    for f in here.rglob("*.py"):
        names |= set(re.findall(r'/ "([A-Za-z_][A-Za-z0-9_]*)\.py"', f.read_text()))
        if f.parent.name == "jobs":
            names.add(f.stem)
    assert names and not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)


def test_recording_never_imports_pyarrow_or_pandas_into_the_job(tmp_path):
    """The job writes its shards without Arrow (trace.frames): pyarrow costs a job ~50 MB
    and its flushes, and imports pandas the first time it converts values (seconds, a
    forked child that imports it hangs, an error at exit). A job that records (and forks
    a worker that records) ends without either imported, and every value round-trips:
    non-ASCII names, its own and its child's spans. Nor does `record` itself import pandas
    while it merges the shards (0.4-0.6 s of a ~1.4 s `record` of a job doing nothing)."""
    import subprocess
    import sys

    from tests.conftest import GPUTRACE

    job = tmp_path / "job.py"
    job.write_text(
        "import multiprocessing as mp, sys, time, gputrace\n"
        "def work(w):\n"
        "    for i in range(300):\n"
        "        t = time.time_ns()\n"
        "        gputrace.record_span('user', f'w{w}.{i}.é', t, t + 5)\n"
        "if __name__ == '__main__':\n"
        "    work(0); time.sleep(0.7); work(1)\n"
        "    p = mp.get_context('fork').Process(target=work, args=(2,)); p.start(); p.join()\n"
        "    print('pandas' in sys.modules, 'pyarrow' in sys.modules, p.exitcode)\n")
    out = tmp_path / "t.arrow"
    p = subprocess.run([*GPUTRACE, "record", "-q", "-o", str(out), "--", sys.executable,
                        str(job)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False", "0"], (p.stdout, p.stderr)
    # every process's imports (the launcher's, the job's, its child's), one line each
    assert "| gputrace.record" in p.stderr
    assert not [ln for ln in p.stderr.splitlines() if ln.rstrip().endswith("| pandas")]
    names = [n for n in load(out).table.column("name").to_pylist() if n.startswith("w")]
    assert sorted(names) == sorted(f"w{w}.{i}.é" for w in range(3) for i in range(300))
