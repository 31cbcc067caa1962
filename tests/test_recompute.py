"""Activation checkpointing: the forward recomputed inside the backward is t_b's, named as
its part, never t_f's, at every `--layers` choice. A job of residual blocks each under
torch.utils.checkpoint (non-reentrant, reentrant) or `checkpoint_wrapper` times its own
forward, backward and recompute (tests/jobs/checkpointed.py: each block times its own
forward body; the loop knows when it stands in its backward call), against which the
analysis of the real recording is held."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gputrace import load  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402
from tests.tracebuilder import MS, Builder  # noqa: E402
from tests.truth import compare, matched, per_iteration  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "jobs" / "checkpointed.py")
BLOCKS = 4
STEPS = 14
TERMS = ("t_io", "t_h2d", "t_f", "t_b", "t_u", "t_comm", "t_other", "t_framework")
# the record options of each --layers choice
LAYERS = {"default": [], "blocks-forward": ["--layer-forward"],
          "leaves-forward": ["--layers", "leaves", "--layer-forward"],
          "leaves": ["--layers", "leaves"], "off": ["--layers", "off"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One recording per (checkpointing mode, --layers choice): the job's own times and the
    trace."""
    d = tmp_path_factory.mktemp("recompute")
    cache: dict[tuple[str, str], tuple[list, Path]] = {}

    def get(mode: str, layers: str) -> tuple[list, Path]:
        key = (mode, layers)
        if key not in cache:
            truth, out = d / f"{mode}-{layers}.json", d / f"{mode}-{layers}.arrow"
            p = run_gputrace("record", "-q", *LAYERS[layers], "-o", str(out), "--",
                             sys.executable, JOB, str(truth), "--mode", mode, "--blocks",
                             str(BLOCKS), "--steps", str(STEPS), timeout=600)
            assert p.returncode == 0, p.stderr
            cache[key] = (json.loads(truth.read_text()), out)
        return cache[key]

    return get


def analyzed(out: Path) -> dict:
    return json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)


CASES = [("nonreentrant", layers) for layers in LAYERS] + \
    [(mode, layers) for mode in ("reentrant", "wrapper", "whole")
     for layers in ("default", "leaves-forward")]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "layers"), CASES)
def test_recompute_is_the_backwards_never_the_forwards(runs, mode, layers):
    truth, out = runs(mode, layers)
    rs = per_iteration(load(out))
    pairs = matched(rs, truth)
    # t_f against the job's own forward, t_b against its backward (the recompute in it)
    compare(rs, truth, pairs, {"t_f": ["forward"], "t_b": ["backward"]}, 0.15)
    # the recompute, iteration by iteration, against the blocks' own clocks in the backward
    kept = pairs[3:]
    got = np.array([rs.recompute_s[k] for _, k in kept])
    want = np.array([truth[i]["recompute"] for i, _ in kept])
    assert (want > 0).all() and (got > 0).all()
    ratio = float(np.median(got / want))
    assert abs(ratio - 1) <= 0.15, (ratio, got.tolist(), want.tolist())
    # a part of t_b, in every iteration
    assert all(rs.recompute_s[k] <= rs.terms["t_b"][k] + 1e-9 for _, k in kept)

    doc = analyzed(out)
    b = {k: v["mean"] for k, v in doc["breakdown"].items()}
    # the terms sum to t_iter: the recompute is not counted twice
    assert abs(sum(b[k] for k in TERMS if k in b) / b["t_iter"] - 1) <= 0.01, b
    rc = doc["recompute"]
    assert rc["unavailable"] is None
    assert 0 < rc["mean_s"] <= b["t_b"]
    assert rc["share_of_t_b"] == pytest.approx(rc["mean_s"] / b["t_b"], rel=1e-6)
    mean_truth = float(np.mean([truth[i]["recompute"] for i, _ in kept]))
    assert abs(rc["mean_s"] / mean_truth - 1) <= 0.2, (rc["mean_s"], mean_truth)
    # per layer: each block recomputed (blocks: the blocks; leaves: their layers)
    # (the whole model checkpointed: the head after the blocks too)
    layers_seen = {x["layer"] for x in rc["layers"]}
    head = 1 if mode == "whole" else 0
    if layers == "off":
        assert layers_seen == set()
    elif layers.startswith("leaves"):
        # Linear, Linear, LayerNorm per block
        assert layers_seen == set(range(1, 3 * BLOCKS + 1 + head)), layers_seen
    else:
        assert layers_seen == set(range(1, BLOCKS + 1 + head)), layers_seen
        if not head:
            assert sum(x["recompute_s"] for x in rc["layers"]) == \
                pytest.approx(rc["mean_s"], rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["default", "leaves-forward"])
def test_no_checkpointing_is_no_recompute(runs, layers):
    truth, out = runs("none", layers)
    rs = per_iteration(load(out))
    compare(rs, truth, matched(rs, truth), {"t_f": ["forward"], "t_b": ["backward"]}, 0.15)
    rc = analyzed(out)["recompute"]
    assert rc["mean_s"] == 0 and rc["layers"] == [] and rc["unavailable"] is None
    assert not rc["large"]
    assert not any(r["cat"] == "recompute" for r in load(out).table.to_pylist())


@pytest.mark.slow
def test_the_terminal_api_and_report_name_the_recompute(runs, tmp_path):
    import gputrace

    _, out = runs("nonreentrant", "default")
    doc = analyzed(out)
    rc = doc["recompute"]
    assert rc["large"] and rc["share_of_t_b"] > 0.1   # the forward again: a large part of t_b
    text = run_gputrace("analyze", str(out), check=True).stdout
    headline = text.splitlines()[0]
    assert "Activation checkpointing recomputes the forward in the backward: " \
           f"{rc['mean_s'] * 1e3:.1f} ms per iteration, {rc['share_of_t_b']:.0%} of t_b" \
           in headline, headline
    rows = [ln for ln in text.splitlines() if "of which recompute" in ln]
    assert len(rows) == 1 and f"{rc['mean_s'] * 1e3:.1f} ms" in rows[0], rows
    # under t_b's row
    lines = text.splitlines()
    assert lines[lines.index(rows[0]) - 1].split()[0] == "t_b"

    r = gputrace.analyze(str(out), progress=False)
    t = r.table("recompute").records()
    whole = [x for x in t if x["layer"] is None]
    assert len(whole) == 1 and whole[0]["recompute_s"] == pytest.approx(rc["mean_s"])
    assert {x["layer"] for x in t if x["layer"] is not None} == set(range(1, BLOCKS + 1))

    page = tmp_path / "r.html"
    run_gputrace("report", str(out), "-o", str(page), check=True)
    html = page.read_text()
    assert "of which recompute" in html and f"{rc['mean_s'] * 1e3:.1f} ms" in html


def _older_trace(path: Path, gpu: bool, recompute: bool = True) -> Path:
    """An older recorder's trace of a checkpointed job (`--layer-forward`): its recompute
    was written as layer `forward` spans inside the backward. Iterations of 100 ms: forward
    5-30 (layers 1, 2), backward 30-85 (layer 2 then 1), in which layer 2's forward ran again
    at 32-40 and layer 1's at 56-62 (14 ms), update 88-95. `gpu`: each layer's span and the
    update launched one kernel of half its length, its phase the innermost range open at its
    launch (the recompute's: the forward). `recompute` False: the same job unchecked."""
    b = Builder()
    kernels = []
    for k in range(8):
        t = 100 * k
        b.span("iteration", t, t + 100, step=k)
        spans = [("forward", t + 5, t + 30, -1), ("forward", t + 5, t + 16, 1),
                 ("forward", t + 16, t + 28, 2), ("backward", t + 30, t + 85, -1),
                 ("backward", t + 30, t + 55, 2), ("backward", t + 55, t + 85, 1),
                 ("update", t + 88, t + 95, -1)]
        if recompute:
            spans += [("forward", t + 32, t + 40, 2), ("forward", t + 56, t + 62, 1)]
        for cat, s, e, layer in spans:
            b.span(cat, s, e, layer=layer, step=k)
        if gpu:
            for cat, s, e, layer in spans:
                if layer >= 1 or cat == "update":
                    inner = max((x for x in spans if x[1] <= s < x[2]), key=lambda x: x[1])
                    kernels.append((k, s, s + 0.5, s + 0.5 + (e - s) / 2, inner[0]))
    if not gpu:
        return b.write(path)
    import pyarrow as pa

    from gputrace.trace import write_trace

    b.write(path)
    tr = load(path)
    rows = tr.table.to_pylist()
    blank = {c: None for c in tr.table.column_names}
    for k, launch, s, e, phase in kernels:   # as the CUPTI collector writes them
        rows.append({**blank, "kind": "span", "cat": "kernel", "name": "k", "host": b.host,
                     "rank": 0, "pid": 1, "tid": 1, "device": 0, "stream": 7, "step": k,
                     "layer": -1, "start_ns": int(s * MS), "end_ns": int(e * MS),
                     "launch_ns": int(launch * MS), "phase": phase})
    rows.sort(key=lambda r: r["start_ns"])
    write_trace(path, tr.metadata, table=pa.Table.from_pylist(rows, tr.table.schema))
    return path


@pytest.mark.parametrize("gpu", [False, True])
def test_an_older_traces_recompute_is_taken_out_of_the_forward(tmp_path, gpu):
    doc = analyzed(_older_trace(tmp_path / "old.arrow", gpu))
    plain = analyzed(_older_trace(tmp_path / "plain.arrow", gpu, recompute=False))
    b = {k: v["mean"] for k, v in doc["breakdown"].items()}
    rc = doc["recompute"]
    # the forward as the same job's without checkpointing: no recompute in it
    assert b["t_f"] == pytest.approx(plain["breakdown"]["t_f"]["mean"], abs=1e-6)
    assert plain["recompute"]["mean_s"] is None    # no recorder said it looked: not 0
    if gpu:   # the device time of the kernels launched in the recompute: 4 + 3 ms
        assert rc["mean_s"] == pytest.approx(0.007, abs=1e-6)
        assert rc["mean_s"] <= b["t_b"]
    else:
        assert b["t_f"] == pytest.approx(0.025, abs=1e-6)
        assert b["t_b"] == pytest.approx(0.055, abs=1e-6)
        assert rc["mean_s"] == pytest.approx(0.014, abs=1e-6)
    assert abs(sum(b[k] for k in TERMS if k in b) / b["t_iter"] - 1) <= 0.01, b
    assert {x["layer"]: round(x["recompute_s"], 6) for x in rc["layers"]} == \
        ({2: 0.004, 1: 0.003} if gpu else {2: 0.008, 1: 0.006})
    assert rc["unavailable"] is None
