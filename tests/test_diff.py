"""`gputrace diff`: a real CPU training loop (tests/jobs/slowed_phase.py) recorded twice as it
is and once with a busy wait in its backward; each run times itself with perf_counter, and
the change the diff reports is compared with the change the loops measured themselves (two
bucket sizes of DDP, a diff of structure alone: tests/test_diff_buckets.py). A loop whose
samples are slow to load
(tests/jobs/timed_loop.py) with 0 and 2 loader workers: the wait for data it measured itself
goes, and the diff puts the change in the I/O term; that recording beside an imported Kineto
trace of another job: the terms only one of them has."""

from __future__ import annotations

import html.parser
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gputrace  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402
from tests.test_report import browser  # noqa: E402, F401 - the Chromium fixture

JOB = str(Path(__file__).resolve().parent / "jobs" / "slowed_phase.py")
LOOP = str(Path(__file__).resolve().parent / "jobs" / "timed_loop.py")
EXTRA_MS = "8"
pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (trace, the loop's own per-step times): `base`, `again` (the same job
    recorded a second time), `slowed` (backward slowed), `other` (another model)."""
    d = tmp_path_factory.mktemp("diff")
    out = {}
    for name, extra in (("base", []), ("again", []),
                        ("slowed", ["--backward-extra-ms", EXTRA_MS]),
                        ("other", ["--model", "other"])):
        trace, truth = d / f"{name}.arrow", d / f"{name}.json"
        p = run_gputrace("record", "-q", "-o", str(trace), "--", sys.executable, JOB,
                         str(truth), *extra, timeout=300)
        assert p.returncode == 0, p.stderr
        out[name] = (trace, json.loads(truth.read_text()))
    return out


@pytest.fixture(scope="module")
def slowed(runs):
    return gputrace.diff(runs["base"][0], runs["slowed"][0], progress=False)


def own_change(runs, key: str, analyzed: int) -> float:
    """The loops' own change of `key`, over the iterations the diff analyzed (the last)."""
    before = np.mean([s[key] for s in runs["base"][1][-analyzed:]])
    after = np.mean([s[key] for s in runs["slowed"][1][-analyzed:]])
    return float(after - before)


def loaded_alike(d) -> bool:
    """The machine kept the job waiting for a CPU for a like share of its iterations in both
    runs (within 10 points): only then must the iteration's change be beyond noise, as on
    a machine loaded differently the diff cannot tell the job's change from the load's."""
    w, t = d["noise"]["run_wait_s"], d["breakdown"]["t_iter"]
    return abs(w["after"] / t["after"] - w["before"] / t["before"]) < 0.1


def test_slowed_backward_is_found_in_backward_with_the_loops_own_magnitude(runs, slowed):
    n = slowed["iterations"]["after"]
    assert n == slowed["iterations"]["before"] >= 30
    h = slowed["headline"]
    if loaded_alike(slowed):
        assert h["verdict"] == "slower" and h["beyond_noise"]
    else:
        assert h["verdict"] in ("slower", "within noise")
    assert h["explained_by"][0]["term"] == "t_b"       # the largest term of the change
    t_b = slowed["breakdown"]["t_b"]
    want_b = own_change(runs, "backward", n)
    assert want_b > 5e-3                               # the wait is there, and it is large
    assert t_b["beyond_noise"] and t_b["change"] == pytest.approx(want_b, rel=0.15)
    assert t_b["low"] < t_b["change"] < t_b["high"]
    want_iter = own_change(runs, "iteration", n)
    assert h["change"] == pytest.approx(want_iter, rel=0.15)
    # the layer holding the wait, among the backward's layers
    top = slowed["layers"]["backward"]["top"][0]
    extra = float(np.mean([s["extra"] for s in runs["slowed"][1][-n:]]))
    assert top["change"] == pytest.approx(extra, rel=0.2)
    assert slowed["comparable"] and slowed["not_comparable"] is None
    # how the runs were made: the command line differs, by the option that slowed it
    argv_before, argv_after = slowed["made"]["argv"]
    assert "--backward-extra-ms" in argv_after and "--backward-extra-ms" not in argv_before
    # the job's samples/s fell as its own iterations grew (the same batch in both)
    mean_it = {k: np.mean([s["iteration"] for s in runs[k][1][-n:]]) for k in ("base", "slowed")}
    assert slowed["throughput"]["samples_per_s"]["ratio"] == pytest.approx(
        mean_it["base"] / mean_it["slowed"], rel=0.05)


def test_the_same_job_recorded_twice_is_within_noise(runs):
    d = gputrace.diff(runs["base"][0], runs["again"][0], progress=False)
    h = d["headline"]
    assert h["verdict"] == "within noise" and h["low"] < 0 < h["high"]
    assert not h["beyond_noise"]
    # the loops' own difference lies in the interval too
    n = d["iterations"]["after"]
    own = np.mean([s["iteration"] for s in runs["again"][1][-n:]]) - \
        np.mean([s["iteration"] for s in runs["base"][1][-n:]])
    assert abs(h["change"] - own) < h["high"] - h["low"]
    assert d["comparable"]
    # how: each run's stalls and its measured run-queue wait, neither more per iteration
    # than the iteration the loop timed itself
    nz = d["noise"]
    assert nz["method"] == "bootstrap+excursions+run_wait" and h["between_s"] is not None
    for side, name in (("before", "base"), ("after", "again")):
        mean_own = np.mean([s["iteration"] for s in runs[name][1][-n:]])
        assert 0 <= nz["run_wait_s"][side] < mean_own
        assert 0 <= nz["excursions_s"][side] < mean_own


def test_fail_if_slower_exits_1_only_for_the_slowed_run(runs, slowed):
    base, again, slow = (str(runs[k][0]) for k in ("base", "again", "slowed"))
    p = run_gputrace("diff", base, again, "--fail-if-slower", "5")
    assert p.returncode == 0, p.stderr
    assert "within noise" in p.stdout.splitlines()[0]
    p = run_gputrace("diff", base, slow, "--fail-if-slower", "5")
    d = slowed                                        # the same two runs' document
    first = p.stdout.splitlines()[0]
    assert first.startswith("t_iter") and "backward +" in first
    if loaded_alike(d):
        assert p.returncode == 1, p.stderr
        assert "within noise" not in first.split(":")[1]
    else:   # exit 1 exactly where the interval's low end is more than 5 % slower
        assert p.returncode == (1 if d["headline"]["low"] / d["headline"]["before"] > 0.05
                                else 0), p.stderr
    # a limit beyond the change: not slower by that much
    p = run_gputrace("diff", base, slow, "--fail-if-slower", "100000")
    assert p.returncode == 0, p.stderr


@pytest.fixture(scope="module")
def page(runs, tmp_path_factory):
    """`gputrace diff BASE SLOWED --json --report PAGE`: (its JSON document, the page)."""
    path = tmp_path_factory.mktemp("page") / "diff.html"
    p = run_gputrace("diff", str(runs["base"][0]), str(runs["slowed"][0]), "--json",
                     "--report", str(path))
    assert p.returncode == 0, p.stderr
    assert f"report: {path} (" in p.stderr          # stdout stays the JSON
    return json.loads(p.stdout), path.read_text(encoding="utf-8")


def test_json_is_the_api_document(page, slowed):
    doc = page[0]
    assert doc["format"] == "gputrace-diff" and doc["version"] == 1
    assert doc["headline"] == slowed["headline"]      # a fixed seed: the same intervals
    assert doc["breakdown"].keys() == slowed["breakdown"].keys()
    assert {"before", "after"} <= doc["model"].keys()
    assert isinstance(slowed, dict) and slowed == doc   # the API's result is the document
    pd = pytest.importorskip("pandas")
    bd = slowed.to_pandas("breakdown").set_index("term")
    assert isinstance(bd, pd.DataFrame) and list(bd.index) == list(doc["breakdown"])
    assert bd.loc["t_b", "change"] == doc["breakdown"]["t_b"]["change"]
    layers = slowed.to_pandas("layers")
    back = layers[layers["phase"] == "backward"]
    assert list(back["name"]) == [r["name"] for r in doc["layers"]["backward"]["top"]]
    assert list(back["low"]) == [r["low"] for r in doc["layers"]["backward"]["top"]]


class _Page(html.parser.HTMLParser):
    """A page's sections (id -> their text), its headline, and what it would fetch."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.external: list[str] = []
        self.doc: dict | None = None
        self._in: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "src" in a or tag == "link" or not a.get("href", "#").startswith("#"):
            self.external.append(tag)
        key = a.get("id") or ("headline" if a.get("class") == "headline" else None)
        self._in.append(key or "")
        if key:
            self.text[key] = ""

    def handle_endtag(self, tag):
        if self._in:
            self._in.pop()

    def handle_data(self, data):
        for key in filter(None, self._in):
            self.text[key] += data
        if self._in and self._in[-1] == "gputrace-diff":
            self.doc = json.loads(data)


def test_diff_page_agrees_with_the_json_and_shows_the_slowed_layer(runs, page):
    from gputrace.report.diff import headline
    from gputrace.report.html import VEGA_LITE

    doc, text = page
    p = _Page()
    p.feed(text)
    assert p.external == []                 # self-contained: nothing to fetch
    assert p.doc == doc                     # the page carries the document it shows
    h = doc["headline"]
    assert p.text["headline"] == headline(doc)
    for figure in (h["before"], h["after"]):
        assert f"{figure * 1e3:.1f} ms" in p.text["headline"]
    assert f"+{h['change'] * 1e3:.1f} ms" in p.text["headline"]
    specs = json.loads(text.split("const specs = ", 1)[1].split(";\n", 1)[0]
                       .replace("<\\/", "</"))
    assert {"breakdowns", "waterfall", "layers-backward", "timeline-before",
            "timeline-after"} <= specs.keys() <= p.text.keys()
    # the waterfall steps by each term's change, as the JSON has it
    wf = specs["waterfall"]["data"]["values"][0]
    t_b = wf["step"].index("t_b backward")
    assert wf["change"][t_b] == pytest.approx(doc["breakdown"]["t_b"]["change"] * 1e3, abs=1e-3)
    assert wf["end"][-1] == pytest.approx(h["after"] * 1e3, abs=1e-3)
    # the slowed module is the middle of the job's three Linear layers (layer 2 from the
    # input): first among the backward's changes, beyond noise, by about its own wait
    n = doc["iterations"]["after"]
    extra = float(np.mean([s["extra"] for s in runs["slowed"][1][-n:]]))
    first = doc["layers"]["backward"]["top"][0]
    # named by its module path (the FLOP count's), its class beside it
    assert first["name"] == "2 Sequential.2 (Linear)" and first["beyond_noise"] and \
        first["low"] > 0
    assert first["change"] == pytest.approx(extra, rel=0.2)
    rows = p.text["layers-backward"]
    assert rows.index("2 Sequential.2 (Linear)") < rows.index("1 Sequential.0 (Linear)") and \
        "beyond noise" in rows
    # both runs' iterations, one above the other, on one time scale; the wait is inside
    # layer 2's backward in the one after, as long as that step's own wait at least
    lanes = {}
    for run in ("before", "after"):
        v = specs[f"timeline-{run}"]["data"]["values"][0]
        lanes[run] = {(ln, w): e - s for ln, w, s, e in zip(v["lane"], v["what"], v["start"],
                                                           v["end"], strict=True)}
    assert specs["timeline-before"]["layer"][0]["encoding"]["x"]["scale"] == \
        specs["timeline-after"]["layer"][0]["encoding"]["x"]["scale"]
    step = int(p.text["timeline-after"].split("(step ")[1].split(")")[0])
    own = runs["slowed"][1][step]["extra"] * 1e3
    lane = "layer 2 Sequential.2 (Linear)"   # the report's lane: the diff's name of it
    assert lanes["after"][(lane, "backward")] >= own * 0.99
    assert lanes["before"][(lane, "backward")] < own / 4
    assert p.text.keys() >= {"made"} and "--backward-extra-ms" in p.text["made"]
    # every chart is valid Vega-Lite: the report extra's own renderer draws each
    vl = pytest.importorskip("vl_convert")
    svg = {k: vl.vegalite_to_svg(v, vl_version=VEGA_LITE) for k, v in specs.items()}
    assert all(s.startswith("<svg") for s in svg.values())
    assert "2 Sequential.2 (Linear)" in svg["layers-backward"]


def test_report_diff_writes_the_same_page_and_bad_input_is_exit_2(runs, page, tmp_path):
    base, slow = str(runs["base"][0]), str(runs["slowed"][0])
    out = tmp_path / "same.html"
    p = run_gputrace("report", base, slow, "--diff", "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"report: {out} (")
    q = _Page()
    q.feed(out.read_text(encoding="utf-8"))
    assert q.doc == page[0]
    not_a_trace = tmp_path / "notes.arrow"
    not_a_trace.write_text("not a trace\n")
    bad = tmp_path / "bad.html"
    for args, says in ((["report", base, "--diff"], "not 1 input"),
                       (["report", base, slow, base, "--diff"], "not 3 inputs"),
                       (["report", base, str(not_a_trace), "--diff", "-o", str(bad)],
                        "notes.arrow"),
                       (["diff", base, slow, "--report", str(tmp_path / "no" / "x.html")],
                        "does not exist")):
        p = run_gputrace(*args)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in p.stderr, args
    assert not bad.exists()


def test_diff_page_in_chromium(browser, page, tmp_path):  # noqa: F811
    from tests.test_report import open_in_browser

    path = tmp_path / "diff.html"
    path.write_text(page[1], encoding="utf-8")
    state, _ = open_in_browser(browser, path, tmp_path / "shots")
    assert {"breakdowns", "waterfall", "layers-backward", "timeline-before",
            "timeline-after"} <= set(state)
    assert "2 Sequential.2 (Linear)" in state["layers-backward"]["y"]


def test_different_models_are_not_comparable_and_matching_layers_still_compared(runs):
    p = run_gputrace("diff", str(runs["base"][0]), str(runs["other"][0]))
    assert p.returncode == 0, p.stderr
    said = [ln for ln in p.stdout.splitlines() if ln.startswith("Not comparable")]
    assert len(said) == 1 and "layers do not match" in said[0]
    d = gputrace.diff(runs["base"][0], runs["other"][0], progress=False)
    bw = d["layers"]["backward"]
    assert not d["comparable"]
    # the second layer is a Linear in one model and a Conv1d in the other
    assert any("Linear" in n for n in bw["only_before"])
    assert any("Conv1d" in n for n in bw["only_after"])
    assert bw["matched"] >= 1


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    not_a_trace = tmp_path / "notes.arrow"
    not_a_trace.write_text("not a trace\n")
    for after in (str(tmp_path / "missing.arrow"), str(not_a_trace)):
        p = run_gputrace("diff", str(runs["base"][0]), after)
        assert p.returncode == 2
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gputrace: error: ")
        assert "Traceback" not in p.stderr and not p.stdout
    with pytest.raises(gputrace.AnalysisError):
        gputrace.diff(runs["base"][0], tmp_path / "missing.arrow")


@pytest.fixture(scope="module")
def loaders(tmp_path_factory):
    """workers -> (trace, the loop's own per-step times): a loop whose every sample sleeps
    0.3 ms to load (a batch of 64: ~20 ms of I/O), with 0 and 2 loader workers."""
    d = tmp_path_factory.mktemp("loaders")
    out = {}
    for workers in (0, 2):
        trace, truth = d / f"w{workers}.arrow", d / f"w{workers}.json"
        p = run_gputrace("record", "-q", "-o", str(trace), "--", sys.executable, LOOP,
                         str(truth), "--loader", "--steps", "16", "--workers", str(workers),
                         "--item-sleep-ms", "0.3", timeout=300)
        assert p.returncode == 0, p.stderr
        out[workers] = (trace, json.loads(truth.read_text()))
    return out


def test_loader_workers_change_is_put_in_the_io_term_with_the_loops_own_magnitude(loaders):
    d = gputrace.diff(loaders[0][0], loaders[2][0], progress=False)
    n = d["iterations"]["before"]
    assert n == d["iterations"]["after"] >= 10

    def own(workers: int, key: str) -> float:
        steps = loaders[workers][1][-n:]
        return float(np.mean([(s["end"] - s["start"]) / 1e9 if key == "iteration" else s[key]
                              for s in steps]))

    want_io = own(2, "io") - own(0, "io")
    assert own(0, "io") > 0.01 and want_io < -0.005       # the loading was slow, and went
    h = d["headline"]
    assert h["verdict"] == "faster" and h["explained_by"][0]["term"] == "t_io"
    t_io = d["breakdown"]["t_io"]
    assert t_io["beyond_noise"] and t_io["change"] == pytest.approx(want_io, rel=0.15)
    assert t_io["before"] == pytest.approx(own(0, "io"), rel=0.15)
    assert h["change"] == pytest.approx(own(2, "iteration") - own(0, "iteration"), rel=0.15)
    assert "--workers" in " ".join(d["made"]["argv"][1])


def test_imported_kineto_trace_against_a_recording_says_the_terms_only_one_has(
        loaders, shared_data):
    import gzip

    kineto = shared_data / "kineto" / "control.json.gz"
    # what the other tool's file holds, read here: NCCL kernels and copies to the device;
    # the recorded loop is one CPU process: no collective, no device
    events = json.load(gzip.open(kineto))["traceEvents"]
    assert any("nccl" in e.get("name", "").lower() for e in events if e.get("cat") == "kernel")
    assert any("HtoD" in e.get("name", "") for e in events if e.get("cat") == "gpu_memcpy")
    recorded = str(loaders[0][0])
    p = run_gputrace("diff", str(kineto), recorded)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    said = [ln for ln in p.stdout.splitlines() if ln.startswith("Terms only one run has")]
    assert len(said) == 1 and "before: " in said[0] and "comm (all of it)" in said[0]
    d = json.loads(run_gputrace("diff", str(kineto), recorded, "--json", check=True).stdout)
    only = d["terms_only"]
    assert {"t_comm", "t_h2d"} <= set(only["before"])
    assert not {"t_comm", "t_h2d"} & set(only["after"])
    for k in only["before"]:
        assert d["breakdown"][k]["before"] > 0 and d["breakdown"][k]["after"] == 0
    assert d["made"]["imported"] == [[f"kineto {kineto}"], None]
    assert d["made"]["world_size"][1] == 1
