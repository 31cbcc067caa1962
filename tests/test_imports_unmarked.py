"""Traces of other tools without the marks gputrace expects: the profiler's trailing step
stub, and iterations and phases found from what an Nsight Systems export repeats. Each
figure is checked against the raw file, read here without gputrace."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import run_gputrace

DATA = Path(__file__).parent / "data"
ROCM = DATA / "kineto" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"


def _json(*args: str) -> dict:
    p = run_gputrace(*args, "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_rocm_step_is_analyzed_and_the_profilers_stub_dropped():
    d = json.load(gzip.open(ROCM))
    steps = sorted((e["ts"], e["dur"]) for e in d["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and re.fullmatch(r"ProfilerStep#\d+", e.get("name", "")))
    assert len(steps) == 2 and steps[1][1] < 0.01 * steps[0][1]     # the file's shape
    r = _json("analyze", str(ROCM))["ranks"]["0"]
    its = r["iterations"]
    assert its["count"] - its["warmup_skipped"] == 1
    assert r["breakdown"]["t_iter"]["mean"] == pytest.approx(steps[0][1] / 1e6, rel=1e-6)
    # the step's GPU work is in its phases, not "in no phase"
    b = r["breakdown"]
    assert b["t_f"]["mean"] > 0 and b["t_b"]["mean"] > 0 and b["t_u"]["mean"] > 0
    assert b["t_other"]["mean"] < 0.5 * b["t_iter"]["mean"]


def _unzip(name: str, tmp: Path) -> Path:
    out = tmp / name.removesuffix(".gz")
    with gzip.open(DATA / "nsys" / name) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


def _raw_layers(db: sqlite3.Connection) -> dict[int, list[int]]:
    """pid -> the starts of the FSDP blocks' forward ranges on its busiest NVTX thread."""
    rows = db.execute("SELECT start, COALESCE(text, (SELECT value FROM StringIds WHERE "
                      "id = textId)), globalTid FROM NVTX_EVENTS WHERE eventType = 59 "
                      "ORDER BY start").fetchall()
    busiest: dict[int, dict[int, int]] = {}
    for _, _, g in rows:
        t = busiest.setdefault(g >> 24 & 0xFFFFFF, {})
        t[g] = t.get(g, 0) + 1
    out = {}
    for pid, threads in busiest.items():
        g = max(threads, key=threads.get)
        out[pid] = [s for s, text, gg in rows
                    if gg == g and text.startswith("FSDP::pre_forward (blocks.")]
    return out


def _rank_pids(db: sqlite3.Connection) -> list[int]:
    return [p for _, p in sorted((dev, gp >> 24 & 0xFFFFFF) for gp, dev in db.execute(
        "SELECT globalPid, MIN(deviceId) FROM CUPTI_ACTIVITY_KIND_KERNEL GROUP BY globalPid"))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nsys")
    return _unzip("mfu_2gpu_before.sqlite.gz", tmp), _unzip("mfu_2gpu_after.sqlite.gz", tmp)


def test_nsight_export_without_marks_is_split_where_it_repeats(pair):
    src = pair[0]
    db = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    names = dict(db.execute("SELECT id, value FROM StringIds"))
    kernels = [names[s] for (s,) in db.execute(
        "SELECT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL")]
    texts = [t for (t,) in db.execute(
        "SELECT COALESCE(text, (SELECT value FROM StringIds WHERE id = textId)) "
        "FROM NVTX_EVENTS WHERE eventType = 59")]
    # the file: no step mark, forward ops only (emit_nvtx's backward ranges are named
    # "<Op>Backward<N>, seq = ..."; no backward kernel ran)
    assert not any(t.startswith("ProfilerStep") for t in texts)
    assert not any(re.match(r"\w+Backward\d*\b", t) for t in texts)
    assert not any("bwd" in k for k in kernels) and any("flash_fwd" in k for k in kernels)
    layers = _raw_layers(db)
    a = _json("analyze", str(src))
    gpu = {p: [] for p in layers}
    for s, e, gp in db.execute("SELECT start, end, globalPid FROM CUPTI_ACTIVITY_KIND_KERNEL"):
        gpu[gp >> 24 & 0xFFFFFF].append((s, e))
    for rank, pid in enumerate(_rank_pids(db)):
        r = a["ranks"][str(rank)]
        starts = layers[pid]
        periods = [b - s for s, b in zip(starts, starts[1:], strict=False)]
        # one iteration per whole repeat of the block sequence (the ranges it begins with
        # come just before each block's forward range)
        assert r["iterations"]["count"] == len(periods)
        assert not r["iterations"]["synthetic"]
        b = r["breakdown"]
        raw = sum(periods[r["iterations"]["warmup_skipped"]:]) / r["iterations"]["analyzed"]
        assert b["t_iter"]["mean"] == pytest.approx(raw / 1e9, rel=0.03)
        # the GPU computed most of each repeat; all of it is forward, nothing backward
        busy = _busy(gpu[pid], starts[0], starts[-1]) / (starts[-1] - starts[0])
        assert busy > 0.8
        assert b["t_f"]["mean"] > 0.8 * b["t_iter"]["mean"]
        assert b["t_b"]["mean"] == 0
        assert b["t_other"]["mean"] < 0.1 * b["t_iter"]["mean"]
        # no order told relative to a backward that was not found
        for f in r["findings"]:
            assert "after the backward" not in f["message"], f["message"]
    p = run_gputrace("analyze", str(src), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "after backward" not in p.stdout.splitlines()[0]
    assert "no iteration marks; its iterations are the" in p.stderr


def _busy(iv: list[tuple[int, int]], lo: int, hi: int) -> int:
    total, reach = 0, lo
    for s, e in sorted(iv):
        s, e = max(s, reach), min(e, hi)
        if e > s:
            total += e - s
            reach = e
    return total


def test_diff_of_the_pair_is_per_iteration_in_the_raw_direction(pair):
    raw = []
    for src in pair:
        db = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
        per = [b - s for starts in _raw_layers(db).values()
               for s, b in zip(starts, starts[1:], strict=False)]
        raw.append(sum(per) / len(per) / 1e9)
    d = _json("diff", str(pair[0]), str(pair[1]))
    t = d["breakdown"]["t_iter"]
    assert t["before"] == pytest.approx(raw[0], rel=0.1)
    assert t["after"] == pytest.approx(raw[1], rel=0.1)
    # the whole captures are both ~300 ms: per iteration, the after run is the slower
    assert (t["change"] > 0) == (raw[1] > raw[0])
    assert t["change"] == pytest.approx(raw[1] - raw[0], rel=0.5)


def test_kineto_trace_without_step_marks_is_split_where_its_loop_repeats(shared_data,
                                                                         tmp_path):
    d = json.load(gzip.open(shared_data / "kineto/control.json.gz"))
    steps = sorted(e["dur"] * 1000 for e in d["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and e.get("name", "").startswith("ProfilerStep#"))
    assert len(steps) == 6
    # the same trace without its step marks
    d["traceEvents"] = [e for e in d["traceEvents"]
                        if not e.get("name", "").startswith("ProfilerStep#")]
    src = tmp_path / "rank3.json.gz"
    with gzip.open(src, "wt") as f:
        json.dump(d, f)
    out = tmp_path / "t.arrow"
    p = run_gputrace("import", str(src), "-o", str(out), check=True)
    assert "no iteration marks; its iterations are the 5 repeats" in p.stderr
    from gputrace import load

    t = load(out).table.to_pylist()
    its = sorted(r["end_ns"] - r["start_ns"] for r in t if r["cat"] == "iteration")
    # a repeat between two marks' worth of the loop: as long as a step, within 5 %
    assert len(its) == len(steps) - 1
    median = steps[len(steps) // 2]
    assert all(abs(x - median) < 0.05 * median for x in its), (its, steps)


def test_emit_nvtx_and_megatron_ranges_name_their_phase():
    from gputrace.importers.common import phase_of
    from gputrace.importers.nvtx_names import convention_phase, emit_nvtx
    from gputrace.importers.nvtx_ops import NvtxOps

    # names as the mfu export writes them
    assert emit_nvtx("aten::mul, seq = 45328, op_id = 990354") == ("aten::mul", 45328)
    assert emit_nvtx("FSDP::pre_forward (blocks.3._checkpoint_wrapped_module), "
                     "op_id = 990") == ("FSDP::pre_forward (blocks.3._checkpoint_wrapped_module)",
                                        None)
    # Megatron-Core names a range by its caller's module and function, then a suffix
    mc = "megatron.core.transformer.transformer_layer"
    assert convention_phase(f"{mc}._forward_attention.self_attention") == "forward"
    assert convention_phase("megatron.core.pipeline_parallel.schedules.backward_step") \
        == "backward"
    assert convention_phase("megatron.core.pipeline_parallel.schedules."
                            "forward_backward_no_pipelining") is None
    # an op autograd numbered is forward, inside a backward range a recomputation: backward
    ops, key = NvtxOps(), (1, 1)
    assert ops.add(key, 0, 10, "aten::mm", None, 7) == "forward"
    bwd = emit_nvtx("MmBackward0, seq = 7, op_id = 12")[0]
    assert ops.add(key, 20, 40, bwd, phase_of(bwd)[0], 7) == "backward"
    assert ops.add(key, 25, 30, "aten::mm", None, 9) == "backward"
    assert ops.add(key, 50, 60, "aten::mm", None, 11) == "forward"
    assert ops.add(key, 61, 62, "aten::view", None, None) is None


def _busy_ns(db: sqlite3.Connection, device: int) -> int:
    """The union of a device's kernels, copies and memsets in an Nsight export, read raw."""
    iv = sorted(row for t in ("KERNEL", "MEMCPY", "MEMSET") for row in db.execute(
        f"SELECT start, end FROM CUPTI_ACTIVITY_KIND_{t} WHERE deviceId = ?", (device,)))
    total, cur = 0, None
    for s, e in iv:
        if cur is None or s > cur[1]:
            total += cur[1] - cur[0] if cur else 0
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (cur[1] - cur[0] if cur else 0)


def test_gpu_busy_and_idle_where_no_phase_is_known(shared_data):
    """An Nsight export with no forward, backward or update range (2xH100, copies and
    kernels): the device's busy and idle time per iteration, busy as the raw records'
    union on each rank's GPU, and the terminal's line saying the time is not split by
    phase; a trace with phases has the figure in --json but no such line."""
    path = shared_data / "nsys" / "h100_2gpu_1s.sqlite"
    d = _json("analyze", str(path))
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    for r, rd in d["ranks"].items():    # ranks in the order of their lowest GPU
        busy = rd["device_busy"]
        assert busy["busy_s"] * 1e9 == pytest.approx(_busy_ns(db, int(r)), rel=1e-6)
        t_iter = rd["breakdown"]["t_iter"]["mean"]
        assert busy["idle_s"] == pytest.approx(t_iter - busy["busy_s"], abs=1e-9)
    out = run_gputrace("analyze", str(path), check=True).stdout
    assert re.search(r"GPU busy [0-9.]+ ms \(\d+%\) and idle [0-9.]+ ms of each iteration: "
                     r"no forward, backward or update phase was found", out), out
    mfu = run_gputrace("analyze", str(shared_data / "nsys" / "mfu_2gpu_before.sqlite"),
                       check=True).stdout
    assert "GPU busy" not in mfu


_TRAINING = re.compile(r"backward|bwd|dgrad|wgrad|multi_tensor_apply|adam|sgd", re.I)


def test_forward_only_nsight_export_stays_one_window_and_says_why(shared_data):
    """The 2xH100 export: its kernels repeat per layer (a softmax per attention layer, the
    layer's weights copied in before it) and no kernel of a backward pass or an optimizer
    ran, so there is no training step to find: one window, and a line saying why, with
    the period the raw kernels show."""
    path = shared_data / "nsys" / "h100_2gpu_1s.sqlite"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    names = dict(db.execute("SELECT id, value FROM StringIds"))
    devices = [d for (d,) in db.execute(
        "SELECT DISTINCT deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY deviceId")]
    p = run_gputrace("analyze", str(path), "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for rank, dev in enumerate(devices):   # ranks in the order of their lowest GPU
        ks = db.execute("SELECT start, demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL "
                        "WHERE deviceId = ? ORDER BY start", (dev,)).fetchall()
        assert not any(_TRAINING.search(names[n]) for _, n in ks)   # forward only
        layers = [s for s, n in ks if "softmax_warp_forward" in names[n]]
        gaps = sorted(b - a for a, b in zip(layers, layers[1:], strict=False))
        its = d["ranks"][str(rank)]["iterations"]
        assert its["count"] == 1 and its["synthetic"]
        m = re.search(rf"rank {rank}: no iteration marks and no ranges that repeat; one "
                      r"window: its kernels repeat (\d+) times \(median ([0-9.]+) ms.*none "
                      r"of the repeats run a backward or optimizer kernel", p.stderr)
        assert m, p.stderr
        # the repeat is the layer the raw kernels show: as long as the median gap between
        # two attention softmaxes, and no more of them than there are layers
        assert float(m.group(2)) == pytest.approx(gaps[len(gaps) // 2] / 1e6, rel=0.05)
        assert int(m.group(1)) < len(layers)


def test_kineto_kernels_alone_are_split_into_the_steps_they_ran_in(shared_data, tmp_path):
    """A Kineto training trace with its ProfilerStep marks and every host event stripped
    (only the GPU's kernels, copies and memsets left): its iterations from where the
    kernel sequence repeats, one per step, each starting inside its step and as long."""
    d = json.load(gzip.open(shared_data / "kineto/control.json.gz"))
    steps = sorted((e["ts"] * 1000, e["dur"] * 1000) for e in d["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and e.get("name", "").startswith("ProfilerStep#"))
    assert len(steps) == 6
    d["traceEvents"] = [e for e in d["traceEvents"] if e.get("ph") == "M"
                        or e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    src = tmp_path / "rank3.json.gz"
    with gzip.open(src, "wt") as f:
        json.dump(d, f)
    out = tmp_path / "t.arrow"
    p = run_gputrace("import", str(src), "-o", str(out), check=True)
    assert "no iteration marks; its iterations are the 5 repeats of its kernel sequence" \
        in p.stderr, p.stderr
    from gputrace import load

    base = d.get("baseTimeNanoseconds", 0)
    its = sorted((r["start_ns"] - base, r["end_ns"] - r["start_ns"])
                 for r in load(out).table.to_pylist() if r["cat"] == "iteration")
    # the last anchor opens no whole repeat: one iteration per step but the last
    assert len(its) == len(steps) - 1
    for (s, dur), (ts, true) in zip(its, steps, strict=False):
        assert ts <= s < ts + true
        assert dur == pytest.approx(true, rel=0.02)


def _nemo_export(path: Path) -> dict[str, tuple[int, int]]:
    """A hand-built Nsight Systems export of 3 NeMo 2 steps as NsysCallback(nvtx_ranges=True)
    records them: Lightning's closure range holding autograd's emit_nvtx op ranges (an mm
    and its MmBackward0), then NeMo's optimizer step range, one kernel launched in each.
    Returns kernel name -> (start, end) of its first run."""
    g = (7 << 24) | 7          # pid 7, tid 7
    label = "nemo.core.optim.mcore_optim"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT);
        INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', '3.25.0');
        CREATE TABLE StringIds (id INT, value TEXT);
        CREATE TABLE NVTX_EVENTS (start INT, "end" INT, eventType INT, text TEXT, textId INT,
                                  globalTid INT, domainId INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, "end" INT, globalTid INT,
                                                  correlationId INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, "end" INT, deviceId INT,
            streamId INT, correlationId INT, globalPid INT, demangledName INT, shortName INT);
    """)
    kernels = ["gemm_fwd", "gemm_bwd", "multi_tensor_apply_kernel<AdamFunctor<float>>"]
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(kernels)))
    first: dict[str, tuple[int, int]] = {}
    corr = 0
    for k in range(3):
        s = 1_000_000 + k * 100_000
        ranges = [(s, s + 60_000, f"{label}.step.closure"),
                  (s + 5_000, s + 20_000, f"aten::mm, seq = {k}, op_id = {10 * k}"),
                  (s + 25_000, s + 45_000, f"MmBackward0, seq = {k}, op_id = {10 * k + 1}"),
                  (s + 60_000, s + 80_000, f"{label}.step.step")]
        db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, ?, NULL, ?, 0)",
                       [(a, b, t, g) for a, b, t in ranges])
        for i, launch in enumerate((s + 6_000, s + 26_000, s + 61_000)):
            corr += 1
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?)",
                       (launch, launch + 500, g, corr))
            ks, ke = launch + 2_000, launch + 12_000
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 7, ?, ?, ?, ?)",
                       (ks, ke, corr, 7 << 24, i, i))
            first.setdefault(kernels[i], (ks, ke))
    db.commit()
    db.close()
    return first


def test_nemo_optimizer_step_range_is_the_update_phase(tmp_path):
    src = tmp_path / "nemo.sqlite"
    first = _nemo_export(src)
    out = tmp_path / "t.arrow"
    run_gputrace("import", str(src), "-o", str(out), check=True)
    from gputrace import load

    rows = load(out).table.to_pylist()
    phase = {(r["name"], r["start_ns"]): r["phase"] for r in rows if r["cat"] == "kernel"}
    t0 = min(r["start_ns"] for r in rows if r["cat"] == "kernel") - first["gemm_fwd"][0]
    want = {"gemm_fwd": "forward", "gemm_bwd": "backward",
            "multi_tensor_apply_kernel<AdamFunctor<float>>": "update"}
    for name, (s, _) in first.items():
        assert phase[(name, s + t0)] == want[name], (name, phase)
    # the closure holds both passes: it names no phase of its own
    closure = [r for r in rows if r["name"] == "nemo.core.optim.mcore_optim.step.closure"]
    assert len(closure) == 3 and all(r["cat"] == "user" for r in closure)
