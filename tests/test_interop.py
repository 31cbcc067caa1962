"""Import of real Kineto and Nsight Systems traces, analysis of them, and timeline export."""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from gputrace import load
from tests.conftest import run_gputrace

KINETO = ["kineto/two_rank", "kineto/nccl_data.json.gz", "kineto/df_index_resolver.json.gz",
          "kineto/control.json.gz"]
NSYS = ["nsys/mfu_2gpu_before.sqlite", "nsys/h100_2gpu_1s.sqlite"]


# -- brute force, independent of gputrace's interval code ------------------------------------
def _merge(iv):
    out = []
    for s, e in sorted(iv):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(iv, lo, hi):
    return sum(max(0, min(e, hi) - max(s, lo)) for s, e in _merge(iv))


def _intersection(a, b, lo, hi):
    a, b = _merge(a), _merge(b)
    i = j = total = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0], lo), min(a[i][1], b[j][1], hi)
        total += max(0, e - s)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kineto_raw(path: Path):
    """(comm intervals, other GPU intervals, iteration windows) in realtime ns, from the file."""
    d = json.load(gzip.open(path))
    base = d.get("baseTimeNanoseconds", 0)
    comm, gpu, iters = [], [], []
    for e in d["traceEvents"]:
        if e.get("ph") != "X":
            continue
        s = round(e["ts"] * 1000) + base
        iv = (s, s + round(e.get("dur", 0) * 1000))
        if e.get("cat") == "kernel" and e["name"].lower().startswith("nccl"):
            comm.append(iv)
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append(iv)
        elif e["name"].startswith("ProfilerStep#"):
            iters.append(iv)
    return d["distributedInfo"]["rank"], comm, gpu, sorted(iters)


def _expected(comm, gpu, windows, skip):
    windows = windows[skip:]
    tot = [_length(comm, lo, hi) for lo, hi in windows]
    hid = [_intersection(comm, gpu, lo, hi) for lo, hi in windows]
    n = len(windows)
    return sum(tot) / n / 1e9, sum(hid) / n / 1e9


def _analyze(path):
    p = run_gputrace("analyze", "--json", str(path), timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("name", KINETO)
def test_kineto_comm_overlap_matches_brute_force(shared_data, name):
    src = shared_data / name
    files = sorted(src.iterdir()) if src.is_dir() else [src]
    a = _analyze(src)
    assert a["iterations"]["count"] >= 1
    for f in files:
        rank, comm, gpu, iters = _kineto_raw(f)
        r = a["ranks"][str(rank)]
        if not iters:  # the whole window is one iteration
            iters = [(min(s for s, _ in comm + gpu), max(e for _, e in comm + gpu))]
        total, hidden = _expected(comm, gpu, iters, r["iterations"]["warmup_skipped"])
        got = r["overlap"]["comm"]
        assert got["total_s"] == pytest.approx(total, rel=1e-6, abs=1e-9)
        assert got["hidden_s"] == pytest.approx(hidden, rel=1e-6, abs=1e-9)
        assert got["exposed_s"] == pytest.approx(total - hidden, rel=1e-6, abs=1e-9)
        assert total > 0  # every file here has NCCL kernels
        # by kind, the NCCL kernels are exposed where no other GPU record runs (these files'
        # kinds never run side by side): the same figure
        kinds = r["collectives"]["kinds"].values()
        assert sum(k["exposed_s"] for k in kinds) == pytest.approx(total - hidden, rel=1e-5)


@pytest.mark.parametrize("name", NSYS)
def test_nsys_comm_overlap_and_counts(shared_data, tmp_path, name):
    src = shared_data / name
    out = tmp_path / "imported.arrow"
    run_gputrace("import", str(src), "-o", str(out), check=True)
    tr = load(out)
    t = tr.table
    db = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    one = lambda q: db.execute(q).fetchone()[0]  # noqa: E731
    cats = Counter(zip(t.column("kind").to_pylist(), t.column("cat").to_pylist(), strict=True))
    n_kernels = one("SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL")
    assert cats[("span", "kernel")] + cats[("span", "comm")] == n_kernels
    assert cats[("span", "memcpy")] == one("SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY")
    assert cats[("span", "memset")] == one("SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_MEMSET")
    n_nvtx = one("SELECT COUNT(*) FROM NVTX_EVENTS WHERE eventType IN (59, 60)")
    phase_cats = {"iteration", "io", "h2d", "forward", "backward", "update"}
    # an export without iteration marks gets iteration spans where it repeats, one row each
    inferred = [r for r in t.select(["cat", "name", "rank", "start_ns", "end_ns"]).to_pylist()
                if r["cat"] == "iteration" and r["name"].startswith("iteration (repeat of")]
    nvtx_rows = sum(v for (k, c), v in cats.items()
                    if k == "span" and (c == "user" or c in phase_cats))
    assert nvtx_rows - len(inferred) == n_nvtx
    # memcpy bytes and memory kinds survive
    mb = [r for r in t.to_pylist() if r["cat"] == "memcpy"]
    assert sum(r["bytes"] for r in mb) == one("SELECT SUM(bytes) FROM CUPTI_ACTIVITY_KIND_MEMCPY")
    assert {r["dst_kind"] for r in mb} <= {"pageable", "pinned", "device", "managed", None}

    # comm hidden/exposed per rank against the raw tables
    a = _analyze(out)
    names = dict(db.execute("SELECT id, value FROM StringIds"))
    pids = sorted({(dev, gp >> 24 & 0xFFFFFF) for gp, dev in db.execute(
        "SELECT globalPid, MIN(deviceId) FROM CUPTI_ACTIVITY_KIND_KERNEL GROUP BY globalPid")})
    for rank, (_, pid) in enumerate(pids):
        comm, gpu = [], []
        for s, e, short, gp in db.execute(
                "SELECT start, end, shortName, globalPid FROM CUPTI_ACTIVITY_KIND_KERNEL"):
            if gp >> 24 & 0xFFFFFF == pid:
                (comm if names[short].startswith("nccl") else gpu).append((s, e))
        for table in ("CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET"):
            gpu += [(s, e) for s, e, gp in db.execute(
                f"SELECT start, end, globalPid FROM {table}") if gp >> 24 & 0xFFFFFF == pid]
        windows = sorted((r["start_ns"], r["end_ns"]) for r in inferred if r["rank"] == rank)
        if windows:
            # per analyzed iteration: the comm kernels launched in it (their runtime call)
            launch = {c: s for c, s, gt in db.execute(
                "SELECT correlationId, start, globalTid FROM CUPTI_ACTIVITY_KIND_RUNTIME")
                if gt >> 24 & 0xFFFFFF == pid}
            its = a["ranks"][str(rank)]["iterations"]
            utc, clock = db.execute("SELECT utcEpochNs, systemClockNs "
                                    "FROM TARGET_INFO_SESSION_START_TIME").fetchone()
            windows = [(lo - utc + clock, hi - utc + clock)     # to the export's clock
                       for lo, hi in windows[its["warmup_skipped"]:]]
            per = [[] for _ in windows]
            for s, e, short, gp, corr in db.execute(
                    "SELECT start, end, shortName, globalPid, correlationId "
                    "FROM CUPTI_ACTIVITY_KIND_KERNEL"):
                at = launch.get(corr)
                if gp >> 24 & 0xFFFFFF == pid and names[short].startswith("nccl") and at:
                    for k, (lo, hi) in enumerate(windows):
                        if lo <= at < hi:
                            per[k].append((s, e))
            assert len(windows) == its["analyzed"]
            total = sum(_length(c, -1 << 62, 1 << 62) for c in per) / len(per) / 1e9
            hidden = sum(_intersection(c, gpu, -1 << 62, 1 << 62) for c in per) / len(per) / 1e9
        else:
            total = _length(comm, -1 << 62, 1 << 62) / 1e9
            hidden = _intersection(comm, gpu, -1 << 62, 1 << 62) / 1e9
        got = a["ranks"][str(rank)]["overlap"]["comm"]
        assert got["total_s"] == pytest.approx(total, rel=1e-6, abs=1e-9)
        assert got["hidden_s"] == pytest.approx(hidden, rel=1e-6, abs=1e-9)
        # copies from pageable memory are a finding only when they take 1 % of the time
        # (h100_2gpu_1s: 4 copies of a few hundred bytes beside 51 GB from pinned memory)
        pageable = sum(e - s for s, e, gp in db.execute(
            "SELECT start, end, globalPid FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE srcKind = 0")
            if gp >> 24 & 0xFFFFFF == pid)
        t_iter = a["ranks"][str(rank)]["breakdown"]["t_iter"]
        ids = {f["id"] for f in a["ranks"][str(rank)]["findings"]}
        span = t_iter["mean"] * a["ranks"][str(rank)]["iterations"]["count"] * 1e9
        assert ("h2d_pageable" in ids) == (pageable >= 0.01 * span), (pageable, span, ids)


def test_kineto_kernels_are_attributed_to_the_phase_of_their_launch(shared_data, tmp_path):
    out = tmp_path / "k.arrow"
    run_gputrace("import", str(shared_data / "kineto/nccl_data.json.gz"), "-o", str(out),
                 check=True)
    t = load(out).table
    rows = [r for r in t.to_pylist() if r["cat"] in ("kernel", "comm")]
    phases = Counter(r["phase"] for r in rows)
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["update"] > 0
    assert all(r["phase"] == "comm" for r in rows if r["cat"] == "comm")
    # NCCL kernels carry the message size: nelems x 4 bytes for float all-reduce
    d = json.load(gzip.open(shared_data / "kineto/nccl_data.json.gz"))
    want = sorted(e["args"]["In msg nelems"] * 4 for e in d["traceEvents"]
                  if e.get("cat") == "kernel" and "AllReduce" in e["name"])
    got = sorted(r["bytes"] for r in rows if r["cat"] == "comm" and "AllReduce" in r["name"])
    assert got == want
    # kernels launched inside ProfilerStep#N carry step N
    steps = {r["step"] for r in rows}
    assert {4, 5, 6} <= steps


def test_launches_are_matched_within_their_process_and_the_later_call_stands():
    """Correlation ids restart in every process (nsys); a GPU row takes its own process's call,
    the later one where an id was called twice, and none where no call has its id."""
    from gputrace.importers.common import Launches, Rows

    calls = Launches()
    calls.call(1, 7, 1, 10, 100)
    calls.call(2, 7, 2, 20, 200)
    calls.call(1, 7, 1, 11, 150)
    calls.call(1, None, 1, 12, 160)        # no correlation: not a launch anyone can match
    calls.gpu(0, 1, 7)
    calls.gpu(1, 2, 7)
    calls.gpu(2, 2, 8)
    calls.gpu(3, 3, 7)
    at, found = calls.matched()
    assert dict(zip(at.tolist(), map(tuple, found[:, 2:].tolist()), strict=True)) == \
        {0: (1, 11, 150), 1: (2, 20, 200)}

    rows = Rows(chunk=2)                   # patches cross batch boundaries
    for i in range(5):
        rows.add("span", "kernel", f"k{i % 2}", i, i + 1)
    rows.set_many("phase", [1, 3], ["forward", "backward"])
    rows.set_many("phase", [3], ["update"])
    rows.set_many("step", [0, 4], [7, 8])
    t = rows.table()
    assert t.column("phase").to_pylist() == [None, "forward", None, "update", None]
    assert t.column("step").to_pylist() == [7, -1, -1, -1, 8]
    assert t.column("name").to_pylist() == ["k0", "k1", "k0", "k1", "k0"]


def test_a_breakdown_from_gpu_time(shared_data):
    a = _analyze(shared_data / "kineto/control.json.gz")
    b = a["breakdown"]
    assert b["t_f"]["mean"] > 0 and b["t_b"]["mean"] > 0 and b["t_u"]["mean"] > 0
    assert b["t_h2d"]["mean"] > 0   # pinned HtoD copies of the batch
    assert a["model"]["strategy"] == "wfbp_update_after"
    assert a["speedup"]["points"]


def _corrupt_inputs(shared_data, tmp_path):
    good = gzip.open(shared_data / "kineto/nccl_data.json.gz").read()
    cases = {
        "bad.json": b'{"traceEvents": [{"ph": "X", "ts": 1, ',
        "truncated.json.gz": gzip.compress(good)[:5000],
        "huge.json": b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", '
                     b'"ts": 1e300, "dur": 1}]}',
        "wrongtype.json": b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", '
                          b'"ts": "soon", "dur": 1}]}',
        "notrace.json": b'{"hello": 1}',
        "list.json": b'[1, 2, 3]',
        "empty.json": b"",
        # nested deeper than any parser's stack: refused, not a crash or all of memory
        "deep.json": b'{"traceEvents": [' + b"[" * 200_000 + b"]" * 200_000 + b"]}",
        "deeparg.json": b'{"traceEvents": [{"ph": "X", "args": ' + b'{"a": ' * 200_000 + b"1"
                        + b"}" * 200_000 + b"}]}",
    }
    paths = []
    for name, data in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        paths.append(p)
    # an SQLite file without nsys tables, and one with a future schema
    for name, version in (("plain.sqlite", None), ("future.sqlite", "4.0.0")):
        p = tmp_path / name
        db = sqlite3.connect(p)
        db.execute("CREATE TABLE t (x)")
        if version:
            db.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
            db.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', ?)",
                       (version,))
        db.commit()
        db.close()
        paths.append(p)
    # real exports with a value of another type in a column (SQLite allows it)
    for name, sql in (("mixed-device.sqlite", "UPDATE CUPTI_ACTIVITY_KIND_MEMCPY "
                       "SET deviceId = 'gpu0'"),
                      ("mixed-start.sqlite", "UPDATE CUPTI_ACTIVITY_KIND_MEMCPY "
                       "SET start = 'soon' WHERE rowid = 3"),
                      ("mixed-pid.sqlite", "UPDATE CUPTI_ACTIVITY_KIND_RUNTIME "
                       "SET globalTid = 1.5 WHERE rowid = 2")):
        p = tmp_path / name
        shutil.copy(shared_data / "nsys/mfu_2gpu_before.sqlite", p)
        db = sqlite3.connect(p)
        db.execute(sql)
        db.commit()
        db.close()
        paths.append(p)
    return paths


def test_malformed_inputs_give_one_line_and_exit_2(shared_data, tmp_path):
    for p in _corrupt_inputs(shared_data, tmp_path):
        for cmd in (["import", str(p), "-o", str(tmp_path / "o.arrow")],
                    ["analyze", str(p)]):
            r = run_gputrace(*cmd)
            assert r.returncode == 2, (p.name, r.stderr)
            assert r.stderr.strip().count("\n") == 0, (p.name, r.stderr)
            assert "Traceback" not in r.stderr and str(p.name) in r.stderr


def test_two_kineto_files_without_ranks_are_refused(tmp_path, shared_data):
    raw = gzip.open(shared_data / "kineto/nccl_data.json.gz").read()
    d = json.loads(raw)
    del d["distributedInfo"]
    for n in ("a.json", "b.json"):
        (tmp_path / n).write_text(json.dumps(d))
    r = run_gputrace("analyze", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert r.returncode == 2 and "cannot tell its rank" in r.stderr


# -- export -----------------------------------------------------------------------------------
def _expected_tracks(trace):
    """(rank, thread-or-stream) -> span count; (rank, counter name) -> sample count."""
    spans, counters = Counter(), Counter()
    for r in trace.table.to_pylist():
        if r["kind"] == "span":
            key = (r["rank"], f"GPU {r['device']} stream {r['stream']}" if r["device"] >= 0
                   else f"{r['pid']}/{r['tid']}")
            spans[key] += 1
        elif r["kind"] == "sample" and r["value"] is not None:
            name = r["name"] + (f"@GPU {r['device']}" if r["device"] >= 0 else "")
            counters[(r["rank"], name)] += 1
    return spans, counters


def _strip_lane(name):
    return name.rsplit(" (", 1)[0] if name.endswith(")") and " (" in name else name


@pytest.fixture
def mixed_trace(tmp_path, shared_data):
    """A real imported GPU trace plus host samples, written as one gputrace trace."""
    out = tmp_path / "k.arrow"
    run_gputrace("import", str(shared_data / "kineto/two_rank"), "-o", str(out), check=True)
    return out


def test_chrome_export_parses_back_with_every_slice(mixed_trace, tmp_path):
    out = tmp_path / "t.json"
    run_gputrace("export", str(mixed_trace), "--format", "chrome", "-o", str(out), check=True)
    d = json.loads(out.read_text())
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in d["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in d["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    got = Counter()
    for e in d["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and "ts" in e
            rank = int(procs[e["pid"]].split()[-1])
            got[(rank, _strip_lane(names[(e["pid"], e["tid"])]))] += 1
    spans, _ = _expected_tracks(load(mixed_trace))
    assert got == spans


def test_perfetto_export_parses_back_with_every_slice_and_counter(tmp_path):
    pytest.importorskip("perfetto")
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    from tests.tracebuilder import Builder, ddp_iterations

    b = ddp_iterations(Builder(), [([4, 3], 40, 60), ([2, 1], 70, 95)], n=3)
    for k in range(30):
        b.sample("proc.read_bytes", k * 10, k * 4096)
    src = b.write(tmp_path / "t.arrow")
    out = tmp_path / "t.pftrace"
    run_gputrace("export", str(src), "-o", str(out), check=True)
    t = Trace()
    t.ParseFromString(out.read_bytes())
    names, counters, begins, ends, values = {}, set(), Counter(), Counter(), Counter()
    depth: Counter = Counter()
    for p in t.packet:
        if p.HasField("track_descriptor"):
            names[p.track_descriptor.uuid] = p.track_descriptor.name
            if p.track_descriptor.HasField("counter"):
                counters.add(p.track_descriptor.uuid)
        elif p.HasField("track_event"):
            ev = p.track_event
            if ev.type == TrackEvent.TYPE_SLICE_BEGIN:
                begins[ev.track_uuid] += 1
                depth[ev.track_uuid] += 1
            elif ev.type == TrackEvent.TYPE_SLICE_END:
                ends[ev.track_uuid] += 1
                depth[ev.track_uuid] -= 1
                assert depth[ev.track_uuid] >= 0
            elif ev.type == TrackEvent.TYPE_COUNTER:
                values[ev.track_uuid] += 1
    assert begins == ends
    spans, samples = _expected_tracks(load(src))
    got = Counter()
    for u, n in begins.items():
        got[_strip_lane(names[u])] += n
    assert got == Counter({name: n for (_, name), n in spans.items()})
    assert {names[u]: n for u, n in values.items()} == {n: c for (_, n), c in samples.items()}
    assert all(u in counters for u in values)


def test_nsys_gpu_metrics_become_samples(tmp_path):
    """GPU_METRICS (nsys --gpu-metrics-devices) -> `gpu.metric.*` samples per GPU; the
    fixtures here have none, so the table is built as nsys 2026.2 lays it out."""
    p = tmp_path / "m.sqlite"
    db = sqlite3.connect(p)
    db.executescript("""
        CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT);
        INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', '3.25.0');
        CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INT, utcTime TEXT,
          localTime TEXT, systemClockNs INT);
        INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (1700000000000000000, '', '', 1000);
        CREATE TABLE TARGET_INFO_GPU_METRICS (typeId INT, sourceId INT, typeName TEXT,
          metricId INT, metricName TEXT);
        INSERT INTO TARGET_INFO_GPU_METRICS VALUES (65536, 0, 'GH100', 1, 'PCIe RX Throughput'),
          (65536, 0, 'GH100', 2, 'SM Active'), (65537, 0, 'GH100', 1, 'PCIe RX Throughput');
        CREATE TABLE GPU_METRICS (timestamp INT, typeId INT, metricId INT, value INT);
        INSERT INTO GPU_METRICS VALUES (2000, 65536, 1, 40), (3000, 65536, 1, 55),
          (2000, 65536, 2, 90), (2500, 65537, 1, 7);
    """)
    db.commit()
    db.close()
    out = tmp_path / "m.arrow"
    run_gputrace("import", str(p), "-o", str(out), check=True)
    rows = [r for r in load(out).table.to_pylist() if r["kind"] == "sample"]
    got = sorted((r["name"], r["device"], r["start_ns"], r["value"]) for r in rows)
    t0 = 1700000000000000000 - 1000
    assert got == [("gpu.metric.pcie_rx_throughput", 0, t0 + 2000, 40.0),
                   ("gpu.metric.pcie_rx_throughput", 0, t0 + 3000, 55.0),
                   ("gpu.metric.pcie_rx_throughput", 1, t0 + 2500, 7.0),
                   ("gpu.metric.sm_active", 0, t0 + 2000, 90.0)]


def _add_nic_tables(path: Path, samples: list[tuple[int, int, int, int, int, int, float]],
                    metrics: list[tuple[int, int, str, str]]) -> None:
    """The NIC tables of `nsys --nic-metrics`, laid out as nsys's SQLite schema reference
    gives them (none of the real exports here was captured with NIC metrics)."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE TARGET_INFO_NIC_INFO (globalId INT, stateName TEXT NOT NULL,
          nicId INT NOT NULL, name TEXT NOT NULL, deviceId INT NOT NULL, vendorId INT NOT NULL,
          linkLayer INT NOT NULL);
        INSERT INTO TARGET_INFO_NIC_INFO VALUES (NULL, 'up', 0, 'mlx5_0', 4129, 5555, 1),
          (NULL, 'up', 1, 'eth0', 4129, 5555, 2);
        CREATE TABLE NIC_ID_MAP (nicId INT NOT NULL, globalId INT NOT NULL);
        INSERT INTO NIC_ID_MAP VALUES (0, 100), (1, 101);
        CREATE TABLE TARGET_INFO_NETWORK_METRICS (metricsListId INT NOT NULL,
          metricsIdx INT NOT NULL, name TEXT NOT NULL, description TEXT NOT NULL,
          unit TEXT NOT NULL);
        CREATE TABLE NET_NIC_METRIC (start INT NOT NULL, "end" INT NOT NULL,
          globalId INT NOT NULL, portId INT NOT NULL, metricsListId INT NOT NULL,
          metricsIdx INT NOT NULL, value INT NOT NULL);
    """)
    db.executemany("INSERT INTO TARGET_INFO_NETWORK_METRICS VALUES (?, ?, ?, '', ?)", metrics)
    db.executemany("INSERT INTO NET_NIC_METRIC VALUES (?, ?, ?, ?, ?, ?, ?)", samples)
    db.commit()
    db.close()


def test_nsys_nic_metrics_become_link_counters(shared_data, tmp_path):
    """NIC metrics: bytes per interval (or a rate) -> the cumulative counters gputrace's own
    collectors write, so `analyze` reports the IB port's bandwidth like a recorded run's."""
    src = shared_data / "nsys/h100_2gpu_1s.sqlite"
    p = tmp_path / "nic.sqlite"
    p.write_bytes(src.read_bytes())
    db = sqlite3.connect(p)
    (k0, k1), = db.execute("SELECT MIN(start), MAX(end) FROM CUPTI_ACTIVITY_KIND_KERNEL")
    (utc, clock), = db.execute(
        "SELECT utcEpochNs, systemClockNs FROM TARGET_INFO_SESSION_START_TIME")
    db.close()
    metrics = [(0, 0, "IB: Bytes sent", "B"), (0, 1, "IB: Bytes received", "B/s"),
               (0, 2, "CNPs sent", "packets"), (1, 0, "Bytes sent", "bytes")]
    period = 10_000_000
    samples, sent, recv_rate = [], [], []
    t = k0 + 50_000_000
    i = 0
    while t + period < k1 - 50_000_000:
        sent.append(1_000_000 + 7919 * i)
        recv_rate.append(2_000_000_000 + 1_000_000 * i)         # B/s over 10 ms
        samples += [(t, t + period, 100, 1, 0, 0, sent[-1]),
                    (t, t + period, 100, 1, 0, 1, recv_rate[-1]),
                    (t, t + period, 100, 1, 0, 2, i % 3),
                    (t, t + period, 101, 0, 1, 0, 500)]
        t += period
        i += 1
    _add_nic_tables(p, samples, metrics)
    out = tmp_path / "nic.arrow"
    run_gputrace("import", str(p), "-o", str(out), check=True)
    rows = [r for r in load(out).table.to_pylist() if r["kind"] == "sample"]
    by = {}
    for r in rows:
        by.setdefault(r["name"], []).append(r)
    assert set(by) == {"ib.mlx5_0.1.xmit_bytes", "ib.mlx5_0.1.rcv_bytes",
                       "nic.mlx5_0.1.cnps_sent", "net.eth0.sent_bytes"}
    tx = sorted(by["ib.mlx5_0.1.xmit_bytes"], key=lambda r: r["start_ns"])
    assert tx[0]["start_ns"] == samples[0][0] + utc - clock and tx[0]["value"] == 0
    assert [r["value"] for r in tx[1:]] == [float(sum(sent[:j + 1])) for j in range(len(sent))]
    assert {r["unit"] for r in tx} == {"bytes"} and {r["cat"] for r in tx} == {"ib"}
    rx = max(r["value"] for r in by["ib.mlx5_0.1.rcv_bytes"])
    assert rx == pytest.approx(sum(v * period / 1e9 for v in recv_rate))
    assert len(by["nic.mlx5_0.1.cnps_sent"]) == len(sent)
    assert max(r["value"] for r in by["net.eth0.sent_bytes"]) == 500 * len(sent)

    d = json.loads(run_gputrace("analyze", str(p), "--json", check=True).stdout)
    for rk in d["ranks"].values():
        links = {link["name"]: link for link in rk["bandwidth"]["links"]}
        window = rk["bandwidth"]["window_s"]
        assert links["ib.mlx5_0.1.xmit_bytes"]["bytes"] == pytest.approx(sum(sent))
        assert links["ib.mlx5_0.1.rcv_bytes"]["bytes"] == pytest.approx(rx)
        assert links["ib.mlx5_0.1.xmit_bytes"]["bytes_per_s"] == \
            pytest.approx(sum(sent) / window)

    bad = tmp_path / "badnic.sqlite"
    bad.write_bytes(src.read_bytes())
    _add_nic_tables(bad, [(k0, k0 + 1, 100, 1, 0, 0, "lots")], metrics)
    r = run_gputrace("import", str(bad), "-o", str(tmp_path / "b.arrow"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "NIC metric value" in r.stderr


@pytest.mark.parametrize("name", ["nccl_data.json.gz", "control.json.gz",
                                  "df_index_resolver.json.gz", "two_rank"])
def test_real_kineto_gpu_traces_have_forward_backward_and_update(shared_data, name):
    """PyTorch-profiler traces of real GPU jobs name no forward phase: it is found from the
    loop thread's operators, backward from autograd's functions (on its device threads),
    and the GPU records launched in them take those phases."""
    from gputrace.analyzers import analyze
    from gputrace.importers import import_paths

    tr = import_paths([str(shared_data / "kineto" / name)])
    rows = tr.table.select(["cat", "phase", "name"]).to_pylist()
    gpu = [r for r in rows if r["cat"] in ("kernel", "memcpy", "memset")]
    attributed = sum(r["phase"] is not None for r in gpu)
    assert attributed >= 0.85 * len(gpu), (attributed, len(gpu))
    assert {"forward", "backward", "update"} <= {r["phase"] for r in gpu}
    assert any(r["name"] == "forward (inferred)" for r in rows)
    b = analyze(tr).main.breakdown
    assert b["t_f"].mean > 0 and b["t_b"].mean > 0 and b["t_u"].mean > 0
    assert abs(b["t_other"].mean) <= 0.10 * b["t_iter"].mean


def test_kineto_events_of_unusual_types_give_the_rows_of_usual_ones(tmp_path):
    """A batch of usual events is converted a column at a time, one with a value of an
    unusual type event by event: the rows are the same, the unusual event skipped."""
    evs = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 10,
         "pid": 1, "tid": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.5, "dur": 0.1,
         "pid": 1, "tid": 2, "args": {"correlation": 5}},
        {"ph": "X", "cat": "Kernel", "name": "ncclKernel_AllReduce", "ts": 2.25, "dur": 3,
         "pid": 0, "tid": 7, "args": {"correlation": 5, "In msg nelems": 10,
                                      "dtype": "Float"}},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1.5, "pid": 0, "tid": 7,
         "args": {"device": "a", "correlation": 1.5}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 3,
         "dur": 1, "pid": 0, "tid": 7, "args": {"bytes": 100, "correlation": 9}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 0.7,
         "dur": 0.1, "pid": 1, "tid": 2},
        {"ph": "X", "cat": "cpu_op", "name": 12, "ts": 0.1, "dur": 1, "pid": 1, "tid": 2,
         "args": []},
        {"ph": "i", "cat": "x", "name": "mark", "ts": 1},
    ]
    usual, unusual = tmp_path / "usual", tmp_path / "unusual"
    for d, extra in ((usual, []), (unusual, [{"ph": "X", "cat": ["kernel"], "ts": 1}])):
        d.mkdir()
        (d / "rank0.json").write_text(json.dumps({"traceEvents": evs + extra}))
        run_gputrace("import", str(d), "-o", str(d / "t.arrow"), check=True)
    a, b = (load(str(d / "t.arrow")).table for d in (usual, unusual))
    cols = [c for c in a.column_names if c != "args"]
    assert a.select(cols).to_pylist() == b.select(cols).to_pylist()
    rows = {r["name"]: r for r in a.to_pylist()}
    assert rows["ncclKernel_AllReduce"]["cat"] == "comm"
    assert rows["ncclKernel_AllReduce"]["bytes"] == 40          # 10 float32 elements
    assert rows["ncclKernel_AllReduce"]["start_ns"] == 2250
    assert rows["k"]["cat"] == "kernel" and rows["k"]["device"] == -1   # no device id
    assert rows["Memcpy HtoD (Pageable -> Device)"]["src_kind"] == "pageable"
    assert rows["cudaDeviceSynchronize"]["cat"] == "sync"
    assert rows["ProfilerStep#3"]["cat"] == "iteration" and rows["ProfilerStep#3"]["step"] == 3
    assert "12" in rows and "cudaLaunchKernel" not in rows and "mark" not in rows
