"""FLOPs per iteration and per layer, achieved FLOP/s and MFU, against a job that counts its
own matmul FLOPs (2*m*n*k per product) and times its own layers' forward with perf_counter
(tests/jobs/flops_train.py); the probe's fp32 matmul peak against torch.matmul timed here."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_gputrace

JOB = Path(__file__).resolve().parent / "jobs" / "flops_train.py"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A probe cache of this module's own (only the matmul measured), so that the traces
    recorded here carry it and no other test's does."""
    d = tmp_path_factory.mktemp("flops-probe")
    env = {**os.environ, "GPUTRACE_CACHE_DIR": str(d)}
    p = run_gputrace("probe", "--only", "matmul", "--json", env=env, check=True)
    return env, json.loads(p.stdout)


def record(tmp, env, name, *job_args, flags=("--layer-forward",)):
    out, truth = tmp / f"{name}.arrow", tmp / f"{name}.json"
    run_gputrace("record", "-q", "-o", str(out), *flags, "--", sys.executable, str(JOB),
                 str(truth), *job_args, env=env, check=True, timeout=300)
    doc = json.loads(run_gputrace("analyze", str(out), "--json", env=env, check=True).stdout)
    return out, json.loads(truth.read_text()), doc


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    tmp = tmp_path_factory.mktemp("flops")
    env = cache[0]
    return {"mlp": record(tmp, env, "mlp", "--model", "mlp", "--steps", "7"),
            "block": record(tmp, env, "block", "--model", "block", "--steps", "7")}


def iteration_steps(path):
    from gputrace import load

    rows = [r for r in load(str(path)).table.to_pylist() if r["cat"] == "iteration"]
    return [r["step"] for r in sorted(rows, key=lambda r: r["start_ns"])]


@pytest.mark.parametrize("model", ["mlp", "block"])
def test_flops_per_iteration_and_layer_are_the_jobs_count(runs, model):
    _, truth, doc = runs[model]
    f = doc["flops"]
    assert f["counted"] and f["method"].endswith("FlopCounterMode")
    r = f["ranks"]["0"]
    assert r["flops_f"] == pytest.approx(truth["flops_f"], rel=0.01)
    assert r["flops_b"] == pytest.approx(truth["flops_b"], rel=0.01)
    assert r["model_flops_per_iteration"] == pytest.approx(
        truth["flops_f"] + truth["flops_b"], rel=0.01)
    assert [ly["layer"] for ly in f["layers"]] == list(range(1, len(truth["layers"]) + 1))
    for got, want in zip(f["layers"], truth["layers"], strict=True):
        assert got["name"] == want["name"]
        assert got["flops_f"] == pytest.approx(want["flops_f"], rel=0.01)
        assert got["flops_b"] == pytest.approx(want["flops_b"], rel=0.01)


@pytest.mark.parametrize("model", ["mlp", "block"])
def test_layer_flops_per_s_is_the_jobs_own(runs, model):
    path, truth, doc = runs[model]
    # the job's own forward time per layer over the iterations the analysis kept
    steps = iteration_steps(path)[doc["iterations"]["warmup_skipped"]:]
    for got, want in zip(doc["flops"]["layers"], truth["layers"], strict=True):
        own = want["flops_f"] / float(np.mean([want["forward_s"][s] for s in steps]))
        assert got["achieved_flops_per_s_f"] == pytest.approx(own, rel=0.15), got["layer"]
    # and the iteration's: its FLOPs over the job's own mean iteration time
    own_it = (truth["flops_f"] + truth["flops_b"]) / float(
        np.mean([truth["iterations"][s] for s in steps]))
    assert doc["flops"]["ranks"]["0"]["achieved_flops_per_s"] == pytest.approx(own_it, rel=0.15)


def test_mfu_is_against_the_probed_peak_on_the_cpu(runs, cache):
    _, _, doc = runs["mlp"]
    f = doc["flops"]
    peak = cache[1]["results"]["matmul_cpu_fp32"]["flops_per_s"]
    assert f["peaks"]["vendor"] is None and f["peaks"]["probed"]["flops_per_s"] == peak
    r = f["ranks"]["0"]
    assert r["mfu"]["probed"] == pytest.approx(r["achieved_flops_per_s"] / peak)
    assert r["hfu"] is None      # nothing recomputed
    share = [ly["share_of_peak"] for ly in f["layers"]]
    assert all(s == pytest.approx(ly["achieved_flops_per_s"] / peak)
               for s, ly in zip(share, f["layers"], strict=True))


def test_counted_iteration_is_marked_and_left_out_of_the_timings(runs, cache, tmp_path):
    from gputrace import load

    path, truth, doc = runs["mlp"]
    marks = [r for r in load(str(path)).table.to_pylist() if r["cat"] == "flops"]
    assert len(marks) == 1 and marks[0]["kind"] == "span"
    steps = iteration_steps(path)
    assert marks[0]["step"] not in steps
    assert sorted(steps + [marks[0]["step"]]) == list(range(len(truth["iterations"])))
    assert doc["iterations"]["count"] == len(truth["iterations"]) - 1
    # off: every iteration is there and analyzed, no count
    off, truth_off, doc_off = record(tmp_path, cache[0], "off", "--steps", "5",
                                     flags=("--flops", "off"))
    assert iteration_steps(off) == list(range(5))
    assert not [r for r in load(str(off)).table.to_pylist() if r["cat"] == "flops"]
    assert doc_off["iterations"]["count"] == 5
    assert doc_off["flops"]["unavailable"] == "FLOPs not counted: recorded with --flops off"
    text = run_gputrace("analyze", str(off), env=cache[0], check=True).stdout
    assert "FLOPs not counted: recorded with --flops off" in text


def test_recomputed_forward_is_hardware_flops_not_model_flops(tmp_path, cache):
    _, truth, doc = record(tmp_path, cache[0], "ckpt", "--model", "block", "--checkpoint",
                           "--steps", "4", flags=())
    r = doc["flops"]["ranks"]["0"]
    model = truth["flops_f"] + truth["flops_b"]
    assert r["model_flops_per_iteration"] == pytest.approx(model, rel=0.01)
    assert r["hardware_flops_per_iteration"] == pytest.approx(model + truth["recompute"],
                                                              rel=0.01)
    assert r["hfu"]["probed"] == pytest.approx(
        r["mfu"]["probed"] * r["hardware_flops_per_iteration"] / model)


def test_probed_cpu_matmul_peak_is_torch_matmuls(cache):
    import torch

    got = cache[1]["results"]["matmul_cpu_fp32"]
    n, threads, repeats = got["n"], got["threads"], got["repeats"]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)

    def own() -> float:
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2 * n ** 3 / best

    try:   # the probe again between two of our own, so that both see the same machine
        before = own()
        p = run_gputrace("probe", "--only", "matmul", "--json", "--no-save", env=cache[0],
                         check=True)
        after = own()
    finally:
        torch.set_num_threads(old)
    probed = json.loads(p.stdout)["results"]["matmul_cpu_fp32"]["flops_per_s"]
    assert probed == pytest.approx(max(before, after), rel=0.15)
