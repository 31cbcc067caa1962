"""GPU collectors on the CPU: NVML sampling with a pynvml-shaped fake, CUPTI record conversion
and attribution with a fake record source, driving the same code the real backends use.
The `gpu`-marked tests at the end run the real thing where a GPU is present."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gputrace import load
from gputrace.analyzers import analyze
from gputrace.analyzers.core.frame import build
from gputrace.collectors import Sampler, Unavailable
from gputrace.collectors.cupti import CuptiCollector
from gputrace.collectors.cupti_convert import Converter
from gputrace.collectors.nvml import NvmlCollector
from gputrace.recorder.core import Recorder
from tests.conftest import write_h2d_job
from tests.fakes.cupti import ActivityFlag, ActivityMemcpyKind, ActivityMemoryKind, FakeCupti
from tests.fakes.pynvml import FakeNvml

U32 = 1 << 32


def two_gpus() -> FakeNvml:
    return FakeNvml([
        {"name": "Fake H100", "pcie_counters": [(U32 - 1000, 10), (500, 1010), (1500, 3010)],
         "nvlink": [[(1, 2), (3, 4)], [(11, 2), (13, 4)], [(21, 2), (23, 4)]]},
        {"name": "Fake H100", "unsupported": {"pcie_counters", "power"},
         "pcie_rate": (100, 250)},
    ])


def test_nvml_samples_counters_wraps_and_skips_unsupported_once(tmp_path):
    nv = two_gpus()
    col = NvmlCollector("h", nvml=nv)
    rec = Recorder(str(tmp_path / "t.arrow"), {"host": "h"})
    s = Sampler([col], rec, 100, rec.now_ns)
    for _ in range(3):
        s.tick()
    rec.set_collector("nvml", "ok", **col.settings())
    rec.close()
    tr = load(tmp_path / "t.arrow")
    smp = build(tr.table).samples
    # 32-bit PCIe counter wrapped between the first two readings: +1500, then +1000
    assert list(smp["pcie.tx_bytes@0"].value) == [U32 - 1000, U32 + 500, U32 + 1500]
    assert list(smp["pcie.rx_bytes@0"].value) == [10, 1010, 3010]
    assert smp["pcie.tx_bytes@0"].unit == "bytes"
    # NVLink KiB counters of both links, summed, in bytes
    assert list(smp["nvlink.tx_bytes@0"].value) == [(1 + 3) * 1024, (11 + 13) * 1024,
                                                     (21 + 23) * 1024]
    # no PCIe counters on GPU 1: the throughput fallback, KB/s -> bytes/s
    assert list(smp["pcie.tx@1"].value) == [100 * 1024] * 3
    assert smp["pcie.rx@1"].unit == "bytes/s"
    assert "gpu.power@1" not in smp and len(smp["gpu.power@0"].value) == 3
    assert nv.calls["1.power"] == 1 and nv.calls["1.pcie_counters"] == 1   # asked once
    assert nv.calls["0.power"] == 3
    for name in ("gpu.util", "gpu.mem_util", "gpu.mem_used", "gpu.sm_clock", "gpu.temp"):
        assert len(smp[f"{name}@1"].value) == 3
    md = tr.metadata["collectors"]["nvml"]
    assert md["skipped"] == {"1.pcie_counters": "Not Supported", "1.power": "Not Supported"}
    g0 = md["gpus"][0]
    assert g0["name"] == "Fake H100" and g0["pci_bus_id"] == "00000000:01:00.0"
    assert g0["pcie_gen"] == 4 and g0["pcie_width_max"] == 16 and g0["nvlinks"] == 2
    assert md["p2p_read"] == [["self", "ok"], ["ok", "self"]]


def test_nvml_without_a_driver_says_why():
    with pytest.raises(Unavailable, match="NVML cannot start: Driver Not Loaded"):
        NvmlCollector("h", nvml=FakeNvml([], init_error=9))
    with pytest.raises(Unavailable, match="no GPU"):
        NvmlCollector("h", nvml=FakeNvml([]))


# -- CUPTI ------------------------------------------------------------------------------------
MS = 1_000_000
T0 = 1_700_000_000 * 10**9


def phase_spans(tid=11, step=3):
    """The recorder's span tuples: (cat, name, start, end, tid, step, layer, bytes, args)."""
    return [
        ("iteration", "iteration", T0, T0 + 100 * MS, tid, step, -1, None, None),
        ("h2d", "h2d", T0 + 1 * MS, T0 + 5 * MS, tid, step, -1, None, None),
        ("forward", "forward", T0 + 5 * MS, T0 + 30 * MS, tid, step, -1, None, None),
        ("forward", "layer2", T0 + 10 * MS, T0 + 20 * MS, tid, step, 2, None, None),
        ("backward", "backward", T0 + 30 * MS, T0 + 80 * MS, tid, step, -1, None, None),
        ("update", "update", T0 + 85 * MS, T0 + 95 * MS, tid, step, -1, None, None),
    ]


def fill(cu: FakeCupti, off: int = 0) -> None:
    """Records of one iteration, times on the CUPTI clock (realtime - off)."""
    c = cu.launch(11, T0 + 2 * MS - off)
    cu.memcpy(c, T0 + 2 * MS - off, T0 + 4 * MS - off, 64 << 20, ActivityMemcpyKind.HTOD,
              ActivityMemoryKind.PAGEABLE, ActivityMemoryKind.DEVICE)
    c = cu.launch(11, T0 + 3 * MS - off)
    cu.memcpy(c, T0 + 4 * MS - off, T0 + 5 * MS - off, 64 << 20, ActivityMemcpyKind.HTOD,
              ActivityMemoryKind.PINNED, ActivityMemoryKind.DEVICE)
    c = cu.launch(11, T0 + 12 * MS - off)        # inside layer2, inside forward
    cu.kernel(c, "volta_sgemm_128x64_nn", T0 + 12 * MS - off, T0 + 25 * MS - off)
    c = cu.launch(11, T0 + 35 * MS - off)
    cu.kernel(c, "conv2d_grad", T0 + 35 * MS - off, T0 + 70 * MS - off)
    c = cu.launch(22, T0 + 50 * MS - off)        # the comm thread has no phase open
    cu.kernel(c, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", T0 + 50 * MS - off,
              T0 + 78 * MS - off, stream=13)
    c = cu.launch(11, T0 + 36 * MS - off)
    cu.memset(c, T0 + 36 * MS - off, T0 + 37 * MS - off, 4096)
    c = cu.launch(11, T0 + 86 * MS - off)
    cu.kernel(c, "sgd_update", T0 + 86 * MS - off, T0 + 90 * MS - off)
    c = cu.launch(11, T0 + 97 * MS - off)         # between phases
    cu.kernel(c, "loss_print", T0 + 97 * MS - off, T0 + 98 * MS - off)
    cu.marker(1, "my_user_range", T0 + 40 * MS - off, ActivityFlag.MARKER_START, "app")
    cu.marker(1, "", T0 + 60 * MS - off, ActivityFlag.MARKER_END, "app")
    cu.marker(2, "forward", T0 + 5 * MS - off, ActivityFlag.MARKER_START, "gputrace")
    cu.marker(2, "", T0 + 30 * MS - off, ActivityFlag.MARKER_END, "gputrace")


def rows_by_name(rows):
    from gputrace.trace.schema import COLUMN_NAMES

    return {r[2]: dict(zip(COLUMN_NAMES, r, strict=True)) for r in rows}


def test_cupti_records_become_rows_with_phase_step_bytes_and_memory_kinds():
    cu = FakeCupti()
    conv = Converter(cu, host="h", rank=1, pid=4242)
    conv.add_spans(phase_spans())
    fill(cu)
    cu.activity_flush_all(0)  # nothing registered: keep records queued
    conv.feed(cu.queued)
    first = conv.drain()
    assert "loss_print" not in {x[2] for x in first}   # launched after every closed phase
    r = rows_by_name(first + conv.drain(final=True))
    assert r["volta_sgemm_128x64_nn"]["phase"] == "forward"   # innermost open range
    assert r["conv2d_grad"]["phase"] == "backward"
    assert r["sgd_update"]["phase"] == "update"
    assert r["loss_print"]["phase"] is None
    nccl = r["ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    assert nccl["cat"] == "comm" and nccl["phase"] == "comm" and nccl["stream"] == 13
    assert r["Memset"]["bytes"] == 4096 and r["Memset"]["phase"] == "backward"
    assert all(x["rank"] == 1 and x["pid"] == 4242 and x["step"] == 3
               for x in r.values() if x["cat"] != "user")
    assert r["my_user_range"]["cat"] == "user" and r["my_user_range"]["end_ns"] - \
        r["my_user_range"]["start_ns"] == 20 * MS
    assert "forward" not in r      # markers on gputrace's own domain are recorded already


def test_cupti_memcpy_kinds_and_bytes():
    cu = FakeCupti()
    conv = Converter(cu, host="h", rank=0, pid=1)
    conv.add_spans(phase_spans())
    fill(cu)
    conv.feed(cu.queued)
    rows = [r for r in conv.drain() if r[1] == "memcpy"]
    got = sorted((r[15], r[16], r[17], r[20]) for r in rows)
    assert got == [(64 << 20, "pageable", "device", "h2d"), (64 << 20, "pinned", "device", "h2d")]
    assert {r[2] for r in rows} == {"Memcpy HTOD"}


def test_cupti_records_wait_for_their_phase_to_close():
    cu = FakeCupti()
    conv = Converter(cu, host="h", rank=0, pid=1)
    c = cu.launch(11, T0 + 12 * MS)
    cu.kernel(c, "k", T0 + 12 * MS, T0 + 13 * MS)
    conv.feed(cu.queued)
    assert conv.drain() == []                     # forward still open: nothing known yet
    conv.add_spans(phase_spans())                 # the flusher later sees it closed
    (row,) = conv.drain()
    assert row[20] == "forward"


def test_cupti_collector_in_a_recorder_writes_attributed_gpu_time(tmp_path):
    off = 5 * 10**9                               # a CUPTI clock 5 s behind realtime
    cu = FakeCupti(clock_offset_ns=off)
    rec = Recorder(str(tmp_path / "t.arrow"), {"host": "h", "rank": 0})
    col = CuptiCollector(rec, cupti=cu)
    col.start()
    assert {int(k) for k in cu.enabled} >= {10, 1, 2, 5, 12}
    for sp in phase_spans(tid=11, step=0):
        rec.span(sp[0], sp[1], sp[2], sp[3], tid=11, step=0, layer=sp[6])
    fill(cu, off)
    rec.flush()
    rec.close()
    tr = load(tmp_path / "t.arrow")
    md = tr.metadata["collectors"]["cupti"]
    assert md["status"] == "ok" and md["clock_offset_ns"] == pytest.approx(off, abs=10**8)
    (summary,) = [r for r in tr.table.to_pylist() if r["name"] == "cupti.summary"]
    stats = json.loads(summary["args"])
    assert stats["records"]["kernel"] == 4 and stats["records"]["comm"] == 1
    assert stats["dropped"] == 0
    k = [r for r in tr.table.to_pylist() if r["name"] == "conv2d_grad"][0]
    assert abs(k["start_ns"] - (T0 + 35 * MS)) < 10**8 and k["phase"] == "backward"
    # the analysis takes phases from GPU time, as CUDA events recorded when the host enters
    # and leaves each phase give it: the device is idle, waiting for the host, inside them
    a = analyze(tr, skip=0)
    b = a.ranks[0].breakdown
    assert b["t_f"].mean == pytest.approx(0.025, abs=2e-4)     # 5-30: the sgemm at 12-25
    # 30-80: conv grad, memset; less 70-78, where the all-reduce ran and no compute did:
    # that is exposed comm, counted once (the terms sum to t_iter)
    assert b["t_b"].mean == pytest.approx(0.042, abs=2e-4)
    assert b["t_u"].mean == pytest.approx(0.010, abs=2e-4)     # 85-95: after the all-reduce
    assert b["t_h2d"].mean == pytest.approx(0.003, abs=2e-4)
    assert b["t_comm"].mean == pytest.approx(0.028, abs=2e-4)
    comm = a.ranks[0].comm
    assert comm["hidden_s"] == pytest.approx(0.020, abs=2e-4)     # 50-70 ms under conv grad
    assert comm["exposed_s"] == pytest.approx(0.008, abs=2e-4)


def test_cupti_unavailable_here_says_why(tmp_path):
    r = subprocess.run([sys.executable, "-c",
                        "from gputrace.collectors.cupti import availability; "
                        "print(availability())"], capture_output=True, text=True)
    assert r.stdout.startswith(("unavailable: ", "ok"))
    if r.stdout.startswith("unavailable"):
        assert len(r.stdout.strip().splitlines()) == 1


# -- on a GPU machine --------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_real_kernels_and_pinned_faster_than_pageable(tmp_path):
    pytest.importorskip("cupti")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    script = write_h2d_job(tmp_path / "h2d_job.py", 256)
    out = tmp_path / "gpu.arrow"
    p = subprocess.run([sys.executable, "-m", "gputrace", "record", "-o", str(out), "--",
                        sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    rows = load(out).table.to_pylist()
    cp = [r for r in rows if r["cat"] == "memcpy" and r["dst_kind"] == "device"
          and (r["bytes"] or 0) >= 256 << 20]
    bw = {}
    for r in cp:
        bw.setdefault(r["src_kind"], []).append(r["bytes"] / ((r["end_ns"] - r["start_ns"]) / 1e9))
    assert bw.get("pinned") and bw.get("pageable")
    assert min(bw["pinned"]) > max(bw["pageable"]) * 0.9
    assert any(r["cat"] == "kernel" and r["phase"] == "forward" for r in rows)
    print(json.dumps({k: sorted(v) for k, v in bw.items()}))
