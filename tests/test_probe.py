"""`gputrace probe`: real disk, page-cache, memory and gloo all-reduce measurements on this
machine; GPU copies through a cupy fake; the result saved per host, carried by later traces
and compared with achieved bandwidth by analyze."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gputrace import probe
from gputrace.probe import gpu, net
from tests.conftest import run_gputrace
from tests.fakes.cupy import FakeCupy

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = str(ROOT / "samples" / "train_cnn.py")


def test_probe_measures_this_machine_then_traces_carry_it(tmp_path, probe_cache):
    pytest.importorskip("torch")
    work = tmp_path / "work"
    work.mkdir()
    p = run_gputrace("probe", "--json", "--dir", str(work), "--size", "32MiB", timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    r = res["results"]
    assert res["format"] == "gputrace-probe" and res["mode"] == "quick"
    for key in ("disk_read", "cache_read", "memcpy", "allreduce_bus"):
        assert r[key]["status"] == "ok", (key, r[key])
        f = r[key]
        assert f["min_bytes_per_s"] <= f["bytes_per_s"] <= f["max_bytes_per_s"]
        assert f["repeats"] == 3 and f["bytes"] > 0 and f["method"]
    # plausible: a disk does 1 MB/s .. 100 GB/s, the page cache 10 MB/s .. 1 TB/s. Not that
    # the cache beats the disk: a virtual machine's disk can be its host's memory (here,
    # four test workers beside it: disk 1.07 GB/s, page cache 0.71 GB/s)
    assert 1e6 < r["disk_read"]["bytes_per_s"] < 1e11
    assert 1e7 < r["cache_read"]["bytes_per_s"] < 1e12
    assert r["disk_read"]["bytes"] == 32 << 20
    ar = r["allreduce_bus"]
    assert ar["backend"] == "gloo" and ar["processes"] == 2
    # bus bandwidth of 2 processes = algorithm bandwidth * 2(n-1)/n = algbw
    assert ar["bytes_per_s"] == pytest.approx(ar["algbw_bytes_per_s"])
    assert 1e6 < ar["bytes_per_s"] < 1e12
    # no GPU here: each GPU figure says why it is missing
    assert all(r[k]["status"].startswith("unavailable: ") for k in gpu.KEYS)
    mm = r["matmul_cpu_fp32"]    # (tests/test_flops.py compares it with torch.matmul's)
    assert mm["status"] == "ok" and mm["min_flops_per_s"] <= mm["flops_per_s"]
    assert r["matmul_gpu_fp32"]["status"] == "unavailable: no CUDA GPU"
    assert list(work.iterdir()) == [], "the disk test file must be removed"
    saved = json.loads((probe_cache / os.path.basename(probe.cache_path())).read_text())
    assert saved == res

    # a run recorded afterwards carries the probe, and analyze compares against it
    trace = tmp_path / "io.arrow"
    rec = run_gputrace("record", "-o", str(trace), "--", sys.executable, SAMPLE, "--preset",
                       "io", "--iterations", "8", "--data", str(tmp_path / "data"), timeout=300)
    assert rec.returncode == 0, rec.stderr[-2000:]
    info = json.loads(run_gputrace("info", "--json", str(trace), check=True).stdout)
    assert info["probe"]["created"] == res["created"]
    assert info["probe"]["peaks_bytes_per_s"]["disk_read"] == r["disk_read"]["bytes_per_s"]
    a = json.loads(run_gputrace("analyze", "--json", str(trace), check=True).stdout)
    links = {x["name"]: x for x in a["bandwidth"]["links"]}
    assert links["cache"]["peak_bytes_per_s"] == r["cache_read"]["bytes_per_s"]
    assert links["cache"]["fraction_of_peak"] == pytest.approx(
        links["cache"]["bytes_per_s"] / r["cache_read"]["bytes_per_s"])
    assert a["speedup"]["link_bytes_per_s"] == ar["bytes_per_s"]
    text = run_gputrace("analyze", str(trace), check=True).stdout
    assert "of the probed" in text and "peaks from `gputrace probe`" in text


@pytest.mark.parametrize("args, says", [
    (["--size", "12x"], "cannot read --size '12x'"),
    (["--size", "1KiB"], "at least 1MiB"),
    (["--dir", "/nonexistent/dir"], "no such directory"),
    (["--procs", "0"], "at least 1"),
    (["--quick", "--full"], "not allowed with argument"),
    (["--only", "matmul,gemm"], "not a step: gemm"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, says):
    p = run_gputrace("probe", *args)
    assert p.returncode == 2
    assert says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_an_unreadable_cache_is_no_probe(probe_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUTRACE_CACHE_DIR", str(tmp_path))
    path = Path(probe.cache_path("h"))
    assert probe.load_cached("h") is None
    path.write_text("{not json")
    assert probe.load_cached("h") is None
    path.write_text(json.dumps({"format": "something-else", "results": {}}))
    assert probe.load_cached("h") is None
    good = {"format": probe.FORMAT, "host": "h", "results": {"memcpy": {"status": "ok"}}}
    assert probe.save(good) == str(path)
    assert probe.load_cached("h") == good


def test_figure_is_median_and_spread_of_repeats():
    f = probe.figure([2.0, 1.0, 4.0], 8, "m", scale=2.0)
    assert (f["bytes_per_s"], f["min_bytes_per_s"], f["max_bytes_per_s"]) == (8.0, 4.0, 16.0)
    assert probe.figure([], 8, "m")["status"].startswith("unavailable")


def _gpu_probe(monkeypatch, fake):
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupyx", fake.cupyx)
    return gpu.measure(probe.plan("quick", 1 << 20))


@pytest.mark.parametrize("devices, peer", [(1, True), (3, True), (2, False)])
def test_gpu_copies_every_kind_and_every_pair(monkeypatch, devices, peer):
    fake = FakeCupy(devices=devices, peer=peer)
    r = _gpu_probe(monkeypatch, fake)
    for key in ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned", "d2d"):
        assert r[key]["status"] == "ok" and r[key]["bytes"] == 1 << 20
        assert r[key]["bytes_per_s"] > 0 and r[key]["repeats"] == 3
    assert r["h2d_latency"]["bytes"] == 8 and r["h2d_latency"]["seconds"] > 0
    kinds = [k for k, _ in fake.copies]
    assert kinds.count("h2d") == 2 * 4 + 51 and kinds.count("d2h") == 2 * 4 + 51
    if devices == 1:
        assert r["p2p"]["status"] == "unavailable: one GPU: no peer to copy to"
        return
    pairs = r["p2p"]["pairs"]
    assert {(x["src"], x["dst"]) for x in pairs} == \
        {(a, b) for a in range(devices) for b in range(devices) if a != b}
    p2p = [d for k, d in fake.copies if k == "p2p"]
    for x in pairs:
        assert x["can_access_peer"] is peer
        assert ("on_bytes_per_s" in x) is peer
        # 1 warm-up + 3 timed copies with peer access off, the same again with it on
        assert p2p.count((x["src"], x["dst"], 1 << 20, False)) == 4
        assert p2p.count((x["src"], x["dst"], 1 << 20, True)) == (4 if peer else 0)
    assert fake.peer_enabled == set(), "peer access is left as it was found"
    assert r["p2p"]["bytes_per_s"] == max(x.get("on_bytes_per_s", x["off_bytes_per_s"])
                                          for x in pairs)


def test_gpu_probe_says_why_without_cupy_or_a_device(monkeypatch):
    r = _gpu_probe(monkeypatch, FakeCupy(fail_count=True))
    assert all(r[k]["status"] == "unavailable: no CUDA device (CUDARuntimeError: "
               "cudaErrorNoDevice: no CUDA-capable device is detected)" for k in gpu.KEYS)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    r = gpu.measure(probe.plan("quick", 1 << 20))
    assert all("cupy cannot be imported" in r[k]["status"] for k in gpu.KEYS)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_network_links_from_sysfs(tmp_path):
    port = tmp_path / "infiniband" / "mlx5_0" / "ports" / "1"
    _write(port / "rate", "200 Gb/sec (4X HDR)")
    _write(port / "state", "4: ACTIVE")
    down = tmp_path / "infiniband" / "mlx5_1" / "ports" / "1"
    _write(down / "rate", "400 Gb/sec (4X NDR)")
    _write(down / "state", "1: DOWN")
    eth = tmp_path / "net" / "eth0"
    _write(eth / "speed", "25000")
    _write(eth / "operstate", "up")
    (eth / "device").mkdir()
    _write(tmp_path / "net" / "lo" / "speed", "0")
    r = net.measure(str(tmp_path))
    assert r["ib"]["bytes_per_s"] == 25e9 and len(r["ib"]["ports"]) == 2
    assert "nominal" in r["ib"]["method"]
    assert r["nic"]["bytes_per_s"] == 25000e6 / 8
    assert [x["interface"] for x in r["nic"]["interfaces"]] == ["eth0"]
    empty = net.measure(str(tmp_path / "none"))
    assert empty["ib"]["status"] == "unavailable: no InfiniBand port"


@pytest.mark.gpu
def test_gpu_probe_on_a_real_gpu():
    pytest.importorskip("cupy")
    r = gpu.measure(probe.plan("quick", 64 << 20))
    for key in ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned", "d2d"):
        assert r[key]["status"] == "ok", r[key]
    assert r["h2d_pinned"]["bytes_per_s"] > r["h2d_pageable"]["bytes_per_s"]
    assert r["d2d"]["bytes_per_s"] > r["h2d_pinned"]["bytes_per_s"]
    assert 1e-7 < r["h2d_latency"]["seconds"] < 1e-3
