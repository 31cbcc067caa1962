"""`gputrace diff` over repeated runs: tests/jobs/slowed_phase.py recorded 3 times a side with
`gputrace record --repeat 3 --interleave` (A B, B A, A B), as it is on both sides (A/A) and
with a busy wait of a known length in one layer's backward on one side; every run times
itself with perf_counter (one line of its steps per run), and the diff's means and their
change are held to the runs' own clocks. The runs interleaved, the intervals are of the
pairs' differences (`runs+paired`); runs given otherwise, Welch's (`runs+welch`)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gputrace  # noqa: E402
from gputrace.analyzers.compare.diff_runs import paired  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402

JOB = str(Path(__file__).resolve().parent / "jobs" / "slowed_phase.py")
STEPS = "30"
EXTRA_MS = "20"
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def record_pair(d: Path, a: str, b: str, b_args: list[str]) -> dict[str, tuple[list[str], list]]:
    """Sides `a` and `b` recorded 3 times each, interleaved: name -> (its traces in the
    order made, each run's own steps)."""
    p = run_gputrace("record", "-q", "--repeat", "3", "-o", str(d / f"{a}.arrow"),
                     "--interleave", str(d / f"{b}.arrow"),
                     "--", sys.executable, JOB, str(d / f"{a}.jsonl"), "--steps", STEPS,
                     "--", sys.executable, JOB, str(d / f"{b}.jsonl"), "--steps", STEPS,
                     *b_args, timeout=900)
    assert p.returncode == 0, p.stderr
    out = {}
    for name in (a, b):
        traces = [str(d / f"{name}-{i}.arrow") for i in (1, 2, 3)]
        steps = [json.loads(ln) for ln in (d / f"{name}.jsonl").read_text().splitlines()]
        assert all(Path(t).is_file() for t in traces) and len(steps) == 3
        out[name] = (traces, steps)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`a`, `b`: the job as it is, interleaved (A/A); `base`, `slowed`: as it is and with
    the busy wait in its backward, interleaved. The two comparisons are recorded side by
    side (each job is one process of one thread, the machine has two cores): each is a
    neighbour of the other's runs, both of whose sides it meets alike, as a busy machine's
    other work is, and the runs' own clocks are what each side is held to."""
    d = tmp_path_factory.mktemp("diff_runs")
    with ThreadPoolExecutor(2) as pool:
        aa = pool.submit(record_pair, d, "a", "b", [])
        ab = pool.submit(record_pair, d, "base", "slowed", ["--backward-extra-ms", EXTRA_MS])
        return {**aa.result(), **ab.result()}


def own_runs(steps: list[list[dict[str, float]]], key: str, n: int) -> list[float]:
    """Each run's own mean of `key` over the `n` iterations the diff analyzed (the last)."""
    return [float(np.mean([s[key] for s in run[-n:]])) for run in steps]


def own(steps: list[list[dict[str, float]]], key: str, n: int) -> float:
    """A side's own figure: the mean of its runs' own."""
    return float(np.mean(own_runs(steps, key, n)))


def per_run(d) -> int:
    n = d["iterations"]["before"]
    assert n == d["iterations"]["after"] and n % 3 == 0 and n // 3 >= 20
    return n // 3


def test_record_repeat_interleaves_and_names_the_runs(runs):
    made = []
    for pair in (("a", "b"), ("base", "slowed")):
        made = [t for i in range(3) for t in (runs[pair[i % 2]][0][i],
                                              runs[pair[1 - i % 2]][0][i])]
        starts = [gputrace.analyze(t, progress=False).analysis.metadata["start"]["realtime_ns"]
                  for t in made]
        assert starts == sorted(starts)               # A B, B A, A B: in that order
    assert [Path(t).name for t in made] == ["base-1.arrow", "slowed-1.arrow", "slowed-2.arrow",
                                            "base-2.arrow", "base-3.arrow", "slowed-3.arrow"]


def test_three_runs_against_three_of_the_same_job_are_within_noise(runs):
    (ta, sa), (tb, sb) = runs["a"], runs["b"]
    d = gputrace.diff(ta, tb, progress=False)
    nz, h = d["noise"], d["headline"]
    assert nz["method"] == "runs+paired" and nz["paired"] and nz["drift_in_interval"]
    assert nz["runs"] == {"before": 3, "after": 3} and d["runs"] == {"before": ta, "after": tb}
    n = per_run(d)
    # within noise wherever the job's own clock finds no change between its runs (its own
    # pairs' differences, the same test, clear of zero by a tenth of its width); where
    # the machine drifted beyond that (a 95 % interval: 1 in 20 A/A pairs), never called
    # changed against the job's own direction
    truth = paired(own_runs(sa, "iteration", n), own_runs(sb, "iteration", n))
    margin = 0.1 * (truth.high - truth.low)
    if truth.low < -margin and truth.high > margin:
        assert h["verdict"] == "within noise" and h["low"] < 0 < h["high"], (h, truth)
    elif h["beyond_noise"]:
        assert (h["change"] > 0) == (truth.low > 0), (h, truth)
    # the sides' means are the runs' own, and their difference lies in the interval
    assert h["before"] == pytest.approx(own(sa, "iteration", n), rel=0.1)
    assert h["after"] == pytest.approx(own(sb, "iteration", n), rel=0.1)
    assert h["low"] < own(sb, "iteration", n) - own(sa, "iteration", n) < h["high"]
    # each run's figure is its own analysis's, the side's the mean of them
    for side, traces in (("before", ta), ("after", tb)):
        each = [gputrace.analyze(t, progress=False).analysis for t in traces]
        want = [a.ranks[a.slowest_rank].breakdown["t_iter"].mean for a in each]
        assert nz["t_iter_runs"][side] == pytest.approx(want, rel=1e-9)
        assert d["breakdown"]["t_iter"][side] == pytest.approx(np.mean(want), rel=1e-9)
    assert d["comparable"]


def test_a_known_wait_in_one_layer_is_slower_by_the_jobs_own_change(runs):
    (tb, sb), (ts, ss) = runs["base"], runs["slowed"]
    d = gputrace.diff(tb, ts, progress=False)
    n = per_run(d)
    h = d["headline"]
    want = own(ss, "iteration", n) - own(sb, "iteration", n)
    assert want > 10e-3 and d["noise"]["method"] == "runs+paired"
    assert h["change"] == pytest.approx(want, rel=0.25)
    # slower beyond noise wherever the job's own clock tells the change from the drift
    # between its runs (its own pairs' differences, the same test); never faster
    truth = paired(own_runs(sb, "iteration", n), own_runs(ss, "iteration", n))
    assert h["verdict"] != "faster" and h["high"] > 0
    if truth.low > 0.25 * want:
        assert h["verdict"] == "slower" and h["beyond_noise"] and h["low"] > 0
    t_b = d["breakdown"]["t_b"]
    want_b = own(ss, "backward", n) - own(sb, "backward", n)
    assert t_b["change"] == pytest.approx(want_b, rel=0.25)
    assert h["explained_by"] == [] or h["explained_by"][0]["term"] == "t_b"
    top = d["layers"]["backward"]["top"][0]          # the layer holding the wait
    assert top["change"] == pytest.approx(own(ss, "extra", n), rel=0.25)
    extra = paired([0.0] * 3, own_runs(ss, "extra", n))
    if extra.low > 0.25 * own(ss, "extra", n):
        assert top["beyond_noise"] and top["low"] > 0
    # runs given in no pairs (slowed-1, slowed-2 next to each other in time, then base-2,
    # base-3): Welch's interval
    w = gputrace.diff(tb[1:], ts[:2], progress=False)
    assert w["noise"]["method"] == "runs+welch" and not w["noise"]["paired"]
    # the samples/s a side's runs had, as its mean iteration (the same batch in all)
    assert d["throughput"]["samples_per_s"]["ratio"] == pytest.approx(
        h["before"] / h["after"], rel=0.01)
    assert w["headline"]["before"] == pytest.approx(np.mean(d["noise"]["t_iter_runs"]
                                                            ["before"][1:]), rel=1e-9)


def test_the_command_line_reads_runs_by_dashes_or_globs_and_gates_on_their_interval(runs):
    (ta, sa), (tb, sb) = runs["a"], runs["b"]
    (base, _), (slowed, _) = runs["base"], runs["slowed"]
    glob_base, glob_slowed = (str(Path(t[0]).parent / f"{k}-*.arrow")
                              for t, k in ((base, "base"), (slowed, "slowed")))
    p = run_gputrace("diff", glob_base, glob_slowed, "--json", "--fail-if-slower", "5")
    by_glob = json.loads(p.stdout)
    assert p.returncode == (1 if by_glob["headline"]["low"] / by_glob["headline"]["before"]
                            > 0.05 else 0), p.stderr
    assert by_glob["runs"] == {"before": base, "after": slowed}
    p = run_gputrace("diff", *base, "--", *slowed, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["headline"] == by_glob["headline"]
    p = run_gputrace("diff", *ta, "--", *tb, "--fail-if-slower", "5")
    lines = p.stdout.splitlines()
    h = json.loads(run_gputrace("diff", *ta, "--", *tb, "--json").stdout)["headline"]
    # the gate fails only where the interval's low end is over 5 % slower
    assert p.returncode == (1 if h["low"] / h["before"] > 0.05 else 0), p.stdout + p.stderr
    # A/A: within noise wherever the job's own clock finds no change between its runs (as
    # in the test above); a machine that drifted beyond that is never called changed
    # against the job's own direction
    d = gputrace.diff(ta, tb, progress=False)
    truth = paired(own_runs(sa, "iteration", per_run(d)), own_runs(sb, "iteration", per_run(d)))
    margin = 0.1 * (truth.high - truth.low)
    if truth.low < -margin and truth.high > margin:
        assert p.returncode == 0 and "within noise" in lines[0], p.stdout + p.stderr
    elif h["beyond_noise"]:
        assert (h["change"] > 0) == (truth.low > 0), (h, truth)
    assert "3 runs before, 3 after" in lines[1] and "drift between runs is in them" in lines[1]
    # one run a side: one line says the drift is not in the interval, and what puts it there
    p = run_gputrace("diff", ta[0], tb[0])
    said = [ln for ln in p.stdout.splitlines() if "drift between runs" in ln]
    assert p.returncode == 0 and len(said) == 1 and "3 runs a side" in said[0]


def test_bad_runs_are_one_line_and_exit_2(runs, tmp_path):
    (ta, _), (tb, _) = runs["a"], runs["b"]
    for args in ([*ta, "--"], ["--", *tb], ta, [ta[0], "--", str(tmp_path / "none.arrow")]):
        p = run_gputrace("diff", *args)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)
        assert "Traceback" not in p.stderr
    for args in (["--interleave", "x.arrow", "--", "true"],
                 ["--repeat", "2", "--interleave", "x.arrow", "--", "true"],
                 ["--repeat", "0", "--", "true"]):
        p = run_gputrace("record", *args, cwd=tmp_path)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)


def test_the_page_of_repeated_runs_draws_every_run_and_each_sides_median_run(runs, tmp_path):
    """`diff A1 A2 A3 -- B1 B2 B3 --report`: the page draws each run's mean iteration (the
    document's, the runs' own clocks'), and each side's timeline is its median run's,
    named, with the known wait inside the slowed layer as long as that run's own."""
    from gputrace.report.html import VEGA_LITE
    from tests.test_diff import _Page

    (tb, sb), (ts, ss) = runs["base"], runs["slowed"]
    path = tmp_path / "runs.html"
    p = run_gputrace("diff", *tb, "--", *ts, "--json", "--report", str(path))
    assert p.returncode == 0, p.stderr
    doc, text = json.loads(p.stdout), path.read_text(encoding="utf-8")
    page = _Page()
    page.feed(text)
    assert page.doc == doc
    specs = json.loads(text.split("const specs = ", 1)[1].split(";\n", 1)[0]
                       .replace("<\\/", "</"))
    v = specs["runs"]["layer"][0]["data"]["values"][0]
    t = doc["noise"]["t_iter_runs"]
    assert v["t_iter"] == pytest.approx([x * 1e3 for x in t["before"] + t["after"]], abs=1e-3)
    assert v["trace"] == tb + ts and v["run"] == ["before"] * 3 + ["after"] * 3
    n = per_run(doc)
    for side, steps in (("before", sb), ("after", ss)):   # each run's figure, its own clock
        assert t[side] == pytest.approx(own_runs(steps, "iteration", n), rel=0.1)
    assert text.count("(3 runs, one process, ") == 2   # the meta line, a side each
    shown = {}
    for side, traces in (("before", tb), ("after", ts)):
        k = int(np.argsort(t[side])[1])                  # the median of 3
        title = page.text[f"timeline-{side}"]
        assert f"run {k + 1} of 3 ({traces[k]}, the side's median)" in title, title
        shown[side] = (k, int(title.split("(step ")[1].split(")")[0]))
    v = specs["timeline-after"]["data"]["values"][0]
    lanes = {(ln, w): e - s for ln, w, s, e in zip(v["lane"], v["what"], v["start"], v["end"],
                                                   strict=True)}
    k, step = shown["after"]
    own_wait = ss[k][step]["extra"] * 1e3           # that run's own wait in that step
    assert lanes[("layer 2 Sequential.2 (Linear)", "backward")] >= own_wait * 0.99
    vl = pytest.importorskip("vl_convert")
    assert vl.vegalite_to_svg(specs["runs"], vl_version=VEGA_LITE).startswith("<svg")
