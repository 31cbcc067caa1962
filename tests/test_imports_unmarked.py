"""Traces of other tools without the marks gputrace expects: the profiler's trailing step
stub. Each figure is checked against the raw file, read here without gputrace."""

from __future__ import annotations

import gzip
import json
import re
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
