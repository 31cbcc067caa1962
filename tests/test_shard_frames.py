"""A running job's shard (trace.frames): what the recorder drained, written as it is and
turned into the trace's table by whoever reads it. Every value comes back; a shard cut
anywhere (a killed job) or damaged keeps every whole frame before the cut; a frame holding
a value of the wrong type is left out with a warning, never the shard."""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest

from gputrace.recorder.core import Recorder
from gputrace.trace import TraceFormatError, load
from gputrace.trace.frames import MAGIC
from gputrace.trace.schema import COLUMN_NAMES


def _recorder(path, **md):
    return Recorder(str(path), {"host": "h", "rank": 3, **md}, flush_interval_s=1e9)


def _rows(table):
    return [tuple(r[c] for c in COLUMN_NAMES) for r in table.to_pylist()]


def _span(rec, cat, name, s, e, tid, step, layer, nbytes, args):
    return ("span", cat, name, s, e, None, None, "h", 3, rec.pid, tid, -1, -1, step, layer,
            nbytes, None, None, None, args, None, None)


def test_a_shard_reads_back_every_value_the_job_recorded(tmp_path):
    rec = _recorder(tmp_path / "p.spans")
    want = []
    for k in range(3):   # names new in every flush
        t = rec.now_ns()
        rec.span("forward", f"block.{k}.é", t, t + 7, layer=k, nbytes=k * 1000 or None,
                 args={"k": k}, tid=11)
        want.append(_span(rec, "forward", f"block.{k}.é", t, t + 7, 11, 0, k,
                          k * 1000 or None, json.dumps({"k": k}, separators=(",", ":"))))
        p = time.perf_counter_ns()   # a hot hook's span, timed on the perf counter
        rec.push_perf(("backward", f"block.{k}.é", p, p + 9, 12, 4, k, None, None))
        on_clock = rec.clock.from_perf(p)
        want.append(_span(rec, "backward", f"block.{k}.é", on_clock, on_clock + 9, 12, 4, k,
                          None, None))
        # a collector's row, with numpy values and every extension column
        rec.add_rows([("span", "kernel", np.str_(f"gemm{k}"), np.int64(t), np.int64(t + 3),
                       None, None, "h", 3, rec.pid, -1, np.int16(0), 7, k, -1, None, None,
                       None, np.int64(900 + k), None, "forward", np.int64(t - 1))])
        want.append(("span", "kernel", f"gemm{k}", t, t + 3, None, None, "h", 3, rec.pid, -1,
                     0, 7, k, -1, None, None, None, 900 + k, None, "forward", t - 1))
        rec.sample("host", "cpu.util", 12.5 + k, "%", t_ns=t + 1)
        want.append(("sample", "host", "cpu.util", t + 1, None, 12.5 + k, "%", "h", 3, rec.pid,
                     -1, -1, -1, -1, -1, None, None, None, None, None, None, None))
        rec.flush()
        if k == 0:   # said after the shard was opened: the metadata written at close has it
            rec.set_collector("late", "ok: started after the first flush")
    rec.close()
    tr = load(tmp_path / "p.spans")
    got = [r for r in _rows(tr.table) if r[2] != "gputrace.end"]
    assert sorted(got, key=repr) == sorted(want, key=repr)
    assert tr.metadata["rank"] == 3 and tr.metadata["collectors"]["late"]["status"].startswith("ok")
    assert tr.metadata["format"] == "gputrace-trace" and not tr.warnings


def _three_flushes(path):
    """A shard of three flushes of 5 spans each, never closed (the job was killed): its
    bytes and where each frame ends."""
    rec = _recorder(path)
    ends = []
    for k in range(3):
        for i in range(5):
            rec.span("forward", f"f{k}.{i}", 10 * i, 10 * i + 5, tid=1)
        rec.flush()
        ends.append(path.stat().st_size)
    return path.read_bytes(), ends


def test_a_shard_cut_anywhere_keeps_every_whole_frame(tmp_path):
    data, ends = _three_flushes(tmp_path / "full.spans")
    cut = tmp_path / "cut.spans"
    # where the metadata frame ends: its head (kind, 3 zero bytes, length, crc), then its
    # payload (a byte search for the next frame's kind would stop inside them by chance)
    first = len(MAGIC) + 12 + struct.unpack_from("<I", data, len(MAGIC) + 4)[0]
    for n in range(len(data) + 1):
        cut.write_bytes(data[:n])
        if n < first:
            with pytest.raises(TraceFormatError):
                load(cut)
            continue
        tr = load(cut)
        whole = sum(e <= n for e in ends)
        assert tr.num_rows == 5 * whole, n
        assert sorted(set(tr.table.column("name").to_pylist())) == \
            [f"f{k}.{i}" for k in range(whole) for i in range(5)]
        assert len(tr.warnings) == 1 and "was not closed" in tr.warnings[0]


def test_a_damaged_frame_ends_what_is_read(tmp_path):
    data, ends = _three_flushes(tmp_path / "full.spans")
    bad = bytearray(data)
    bad[(ends[0] + ends[1]) // 2] ^= 0xFF   # a byte of the second frame flipped
    (tmp_path / "bad.spans").write_bytes(bytes(bad))
    tr = load(tmp_path / "bad.spans")
    assert sorted(tr.table.column("name").to_pylist()) == [f"f0.{i}" for i in range(5)]
    assert "damaged" in tr.warnings[0]


def test_a_value_of_the_wrong_type_loses_its_frame_not_the_shard(tmp_path):
    rec = _recorder(tmp_path / "p.spans")
    for k in range(3):
        rec.span("forward", f"f{k}", 1, 2, tid=1)
        if k == 1:   # a collector's bug: text where a time goes
            rec.add_rows([("span", "kernel", "k", "not a time", None)])
        rec.flush()
    rec.close()
    tr = load(tmp_path / "p.spans")
    names = tr.table.column("name").to_pylist()
    assert "f0" in names and "f2" in names and "f1" not in names and "k" not in names
    # four frames: three flushes and the closing one (its end marker); one left out
    assert len(tr.warnings) == 1 and "1 of its 4 batches held values" in tr.warnings[0]


def test_the_jobs_own_numpy_values_are_recorded_as_numbers(tmp_path, capsys):
    """marshal would write a numpy scalar as its raw bytes: the job's own calls
    (`record_span`, `record_sample`) are made Python values, a wrong one said once."""
    import gputrace

    out = tmp_path / "run.arrow"
    with gputrace.Session(str(out), sampler=False) as s:
        t = np.int64(s.now_ns())
        s.record_span("user", np.str_("np-span"), t, t + np.int32(5), layer=np.int16(3),
                      nbytes=np.uint32(4096))
        s.record_sample("host", "np-sample", np.float32(2.5), "GB", t_ns=t)
        s.record_span("user", "bad", t, t + 1, layer="three")
        s.record_span("user", "bad", 1.5, 2)
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("gputrace")]
    assert len(said) == 1 and "layer 'three' is not an integer" in said[0], said
    rows = {r["name"]: r for r in load(out).table.to_pylist()}
    assert "bad" not in rows
    sp, sa = rows["np-span"], rows["np-sample"]
    assert (sp["start_ns"], sp["end_ns"] - sp["start_ns"], sp["layer"], sp["bytes"]) == \
        (int(t), 5, 3, 4096)
    assert (sa["start_ns"], sa["value"], sa["unit"]) == (int(t), 2.5, "GB")


@pytest.mark.parametrize("closed", [True, False])
def test_a_rank_learned_in_process_is_every_event_of_the_process(tmp_path, closed):
    """A process whose launcher set no rank (mp.spawn, Lightning's launcher) learns it
    from torch.distributed during the run: what it wrote before carried rank -1, and reads
    back with the rank it learned, whether it closed its shard or was killed after."""
    rec = Recorder(str(tmp_path / "p.spans"), {"host": "h", "rank": -1, "world_size": -1},
                   flush_interval_s=1e9)
    answers = iter([None, (1, 2)])
    rec.rank_source = lambda: next(answers)
    t = rec.now_ns()
    rec.span("forward", "before", t, t + 5)
    rec.sample("host", "cpu.util", 3.0, "%", t_ns=t)
    rec.flush()                       # the group does not exist yet: written as rank -1
    rec.span("forward", "after", t + 10, t + 15)
    rec.flush()                       # learned: from here on rank 1
    assert rec.rank == 1 and rec.rank_source is None
    if closed:
        rec.close()
    tr = load(tmp_path / "p.spans")
    assert set(tr.table.column("rank").to_pylist()) == {1}
    assert tr.metadata["rank"] == 1 and tr.metadata["world_size"] == 2
    assert {r["name"] for r in tr.table.to_pylist()} >= {"before", "after", "cpu.util"}
