"""On a GPU: gputrace against a CUDA loop that times its own phases with CUDA events
(tests/jobs/cuda_loop.py), recorded with CUPTI and with torch.profiler's Kineto, pageable and
pinned copies, a loop synchronized every step and one that runs ahead; and the CNN sample on
CUDA. Figures are printed (pytest -s) for the record.

Goals: each phase's per-iteration time within 5 % of the CUDA events, t_iter within 2 % of
the loop's own iteration, every kernel and copy of the loop attributed to a phase, and at
most 5 % of the sample's iteration in no phase.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

from gputrace import load
from tests.conftest import run_gputrace
from tests.truth import compare, matched, per_iteration

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
LOOP = str(ROOT / "tests" / "jobs" / "cuda_loop.py")
TERMS = {"t_h2d": ["h2d"], "t_f": ["forward"], "t_b": ["backward"], "t_u": ["update"],
         "t_iter": []}


def _cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")


def record_loop(tmp_path: Path, timeline: str, *args: str,  # type: ignore[no-untyped-def]
                record_args: tuple[str, ...] = ()):
    truth_path, out = tmp_path / "truth.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "--gpu-timeline", timeline, *record_args, "-o", str(out),
                     "--",
                     sys.executable, LOOP, str(truth_path), *args, timeout=600)
    assert p.returncode == 0, p.stderr
    return load(out), json.loads(truth_path.read_text())


@pytest.mark.parametrize("timeline", ["cupti", "kineto"])
@pytest.mark.parametrize("copy", ["pageable", "pinned", "pinned-ahead"])
def test_cuda_loop_phases_match_its_cuda_events(tmp_path, timeline, copy):
    _cuda()
    if timeline == "cupti":
        pytest.importorskip("cupti")
    args = {"pageable": [], "pinned": ["--pinned"],
            "pinned-ahead": ["--pinned", "--sync-every", "8"]}[copy]
    tr, truth = record_loop(tmp_path, timeline, *args)
    col = tr.metadata["collectors"]["cupti"]
    assert col["status"].startswith("ok"), col
    assert col.get("source") == ("cupti" if timeline == "cupti" else "torch.profiler"), col
    gpu = [r for r in tr.table.to_pylist() if r["cat"] in ("kernel", "memcpy", "memset")]
    assert gpu, "no GPU records"
    missing = [r["name"] for r in gpu if r["phase"] is None]
    assert not missing, f"{len(missing)} of {len(gpu)} GPU records in no phase: {missing[:5]}"
    assert all(r["launch_ns"] is not None for r in gpu)
    rs = per_iteration(tr)
    pairs = matched(rs, truth)
    got = compare(rs, truth, pairs, TERMS, tol=0.05, iter_tol=0.02)
    print(json.dumps({"timeline": timeline, "copy": copy, "records": len(gpu),
                      "ms (gputrace, CUDA events)": {k: [round(g * 1e3, 3), round(w * 1e3, 3)]
                                                     for k, (g, w) in got.items()}}))


def test_cupti_is_off_outside_a_window(tmp_path):
    """`--steps 10:5` on the CUDA loop: CUPTI's kinds switched on for the window and off
    around it; GPU records only from launches in the window's iterations, each in a phase,
    the window's phases within 5 % of the loop's CUDA events; every iteration's time kept."""
    _cuda()
    pytest.importorskip("cupti")
    tr, truth = record_loop(tmp_path, "cupti", "--steps", "30",
                            record_args=("--steps", "10:5"))
    rows = tr.table.to_pylist()
    summary = [json.loads(r["args"]) for r in rows if r["name"] == "cupti.summary"]
    assert summary and summary[0]["window_switches"] >= 2, summary
    its = sorted((r for r in rows if r["cat"] == "iteration"), key=lambda r: r["start_ns"])
    lo, hi = its[0]["start_ns"], its[-1]["end_ns"]
    gpu = [r for r in rows if r["cat"] in ("kernel", "memcpy", "memset")]
    assert gpu and all(lo <= r["launch_ns"] <= hi for r in gpu), (lo, hi)
    assert all(r["phase"] is not None for r in gpu)


def test_cnn_sample_on_cuda_has_every_phase(tmp_path):
    _cuda()
    out = tmp_path / "cnn.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable,
                     str(ROOT / "samples" / "train_cnn.py"), "--device", "cuda",
                     "--iterations", "40", "--data", str(tmp_path / "data"), timeout=600)
    assert p.returncode == 0, p.stderr
    d = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    b = {k: v["mean"] for k, v in d["breakdown"].items()}
    print(json.dumps({"train_cnn cuda ms": {k: round(v * 1e3, 3) for k, v in b.items()}}))
    assert b["t_f"] > 0 and b["t_b"] > 0 and b["t_u"] > 0
    assert b["t_other"] <= 0.05 * b["t_iter"], b
    assert d["speedup"]["unavailable"] is None


@pytest.mark.skipif(not os.environ.get("GPUTRACE_CAPTURE_FIXTURES"),
                    reason="set GPUTRACE_CAPTURE_FIXTURES=1 to write tests/data/gpu")
def test_capture_real_records_as_fixtures(tmp_path):
    """Writes the raw CUPTI records and the Kineto JSON of the CUDA loop, with its truth,
    under tests/data/gpu for tests/test_gpu_fixtures.py to replay on any machine."""
    _cuda()
    pytest.importorskip("cupti")
    d = ROOT / "tests" / "data" / "gpu"
    d.mkdir(parents=True, exist_ok=True)
    for timeline, copy in (("cupti", "pageable"), ("cupti", "pinned"), ("kineto", "pinned")):
        args = ["--pinned"] if copy == "pinned" else []
        env = dict(os.environ)
        name = f"{timeline}_{copy}"
        if timeline == "cupti":
            env["GPUTRACE_CUPTI_DUMP"] = str(d / f"{name}.jsonl.gz")
        else:
            env["GPUTRACE_KINETO_KEEP"] = str(d / f"{name}.json")
        truth = d / f"{name}.truth.json"
        p = run_gputrace("record", "-q", "--gpu-timeline", timeline, "-o",
                         str(tmp_path / f"{name}.arrow"), "--", sys.executable, LOOP,
                         str(truth), "--steps", "16", "--batch", "512", *args, env=env,
                         timeout=600)
        assert p.returncode == 0, p.stderr
        if timeline == "kineto":
            raw = d / f"{name}.json"
            with gzip.open(d / f"{name}.json.gz", "wb") as f:
                f.write(raw.read_bytes())
            raw.unlink()
    sizes = {f.name: f.stat().st_size for f in d.iterdir()}
    print(json.dumps(sizes))
    assert sum(sizes.values()) <= 2 << 20
