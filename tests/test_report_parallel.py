"""The report and the timeline export of pipeline- and tensor-parallel runs: real 2-rank jobs
over gloo on the CPU recorded with gputrace (tests/jobs/pp_train.py with torch's 1F1B
schedule; tests/jobs/tp_train.py, Megatron-style blocks through DTensor), the page's
pipeline chart held to torch's own schedule and to the recorded spans, the tensor-parallel
section to the analysis, and the export's tracks and arguments to the trace."""

from __future__ import annotations

import html.parser
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

pytest.importorskip("torch")

from gputrace.analyzers import analyze  # noqa: E402
from gputrace.analyzers.parallel.pp import pipesim  # noqa: E402
from gputrace.analyzers.parallel.tp import as_dict as tp_section  # noqa: E402
from gputrace.report import html as report_html  # noqa: E402
from gputrace.report.charts import WIDTH, charts  # noqa: E402
from gputrace.report.charts_parallel import LABEL_MIN_PX  # noqa: E402
from gputrace.trace import load  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402
from tests.tracebuilder import Builder, ddp_iterations  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"
MB = 4


def _record(out: Path, name: str, script: str, *args: str) -> Path:
    trace = out / f"{name}.arrow"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-m", "gputrace", "record", "-q", "-f", "-o",
                        str(trace), "--", sys.executable, "-m", "torch.distributed.run",
                        "--standalone", "--nproc_per_node", "2", str(JOBS / script),
                        str(out / name), *args], capture_output=True, text=True, timeout=600,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return trace


@pytest.fixture(scope="module")
def pp_trace(tmp_path_factory):
    """A 2-stage pipeline, torch's Schedule1F1B over 4 microbatches."""
    return _record(tmp_path_factory.mktemp("pp"), "pp", "pp_train.py", "--schedule", "1f1b",
                   "--microbatches", str(MB), "--iterations", "6", "--width", "256",
                   "--batch", "64", "--blocks", "2")


@pytest.fixture(scope="module")
def tp_trace(tmp_path_factory):
    return _record(tmp_path_factory.mktemp("tp"), "tp", "tp_train.py", "--iterations", "5")


def _rows(spec: dict) -> list[dict]:
    """A chart's inline data (sent column-wise) as rows."""
    cols = spec["data"]["values"][0]
    return [dict(zip(cols, v, strict=True)) for v in zip(*cols.values(), strict=True)]


class _Page(html.parser.HTMLParser):
    """Ids on the page, and each table's rows (cells' text)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "table":
            self._table = a.get("id") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag == "td" and self._table is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _page(a) -> _Page:
    p = _Page()
    p.feed(report_html.render(a, None, "", "t.arrow"))
    return p


# -- the pipeline ------------------------------------------------------------------------


def test_pipeline_chart_draws_each_stage_in_torchs_1f1b_order_on_one_clock(pp_trace):
    a = analyze(load(pp_trace), detail=True)
    pl = a.main.parallel["pp"]
    chart = {c.id: c for c in charts(a, a.main)}["pipeline"]
    rows = _rows(chart.spec)
    lanes = ["stage 0 (rank 0)", "stage 1 (rank 1)"]
    assert chart.spec["layer"][0]["encoding"]["y"]["sort"] == lanes
    assert sorted({r["lane"] for r in rows}) == lanes
    blocks: dict[int, list[dict]] = {}
    for s, lane in enumerate(lanes):
        mine = [r for r in rows if r["lane"] == lane]
        steps = [r for r in mine if r["what"].startswith("bubble")]
        assert len(steps) == 1             # the stage's schedule step behind its blocks
        work = sorted((r for r in mine if r not in steps), key=lambda r: r["start"])
        # every microbatch's forward and backward, in the order torch's 1F1B runs them
        assert [(r["what"][0].upper(), r["mb"]) for r in work] == \
            pipesim.order("Schedule1F1B", s, 2, MB)
        assert all(r["label"] in ("", str(r["mb"])) for r in work)
        assert all(steps[0]["start"] <= r["start"] < r["end"] <= steps[0]["end"] + 1e-3
                   for r in work)
        blocks[s] = work
    # a block carries its microbatch's number where it is wide enough on the page for it
    # (LABEL_MIN_PX over the chart's WIDTH, which spans the steps): how many are depends
    # on the machine's speed (a busy one stretches some blocks and squeezes the rest: 2 of
    # the 16 were labelled once, where 8 were asked for), the rule does not
    steps = [r for r in rows if r["what"].startswith("bubble")]
    span_ms = max(r["end"] for r in steps) - min(r["start"] for r in steps)
    for r in (r for work in blocks.values() for r in work):
        px = (r["end"] - r["start"]) / span_ms * WIDTH
        assert r["label"] == ("" if px < LABEL_MIN_PX else str(r["mb"])) or \
            abs(px - LABEL_MIN_PX) < 0.01, (r, px)
    # one clock: a microbatch's forward on stage 1 starts after stage 0's ended (its
    # activations arrive), its backward on stage 0 after stage 1's (its gradient)
    at = {(s, r["what"][0], r["mb"]): r for s, w in blocks.items() for r in w}
    for mb in range(MB):
        assert at[(1, "f", mb)]["start"] >= at[(0, "f", mb)]["end"]
        assert at[(0, "b", mb)]["start"] >= at[(1, "b", mb)]["end"]
    # the blocks are the recorded pipeline spans of the iteration drawn
    step = int(chart.spec["layer"][0]["encoding"]["x"]["title"].split("step ")[-1][:-1])
    recorded = Counter((r["rank"], r["name"]) for r in load(pp_trace).table.to_pylist()
                       if r["cat"] == "pipeline" and r["step"] == step)
    assert recorded == Counter({(k, n): MB for k in (0, 1) for n in ("forward", "backward")}
                               | {(k, "step"): 1 for k in (0, 1)})
    assert f"Measured bubble {pl.bubble:.0%} of the iteration" in chart.caption
    assert "(p-1)/(m+p-1) = 20%" in chart.caption and "1F1B, 2 stages x 4" in chart.caption


def test_pipeline_section_holds_the_stages_and_the_what_ifs(pp_trace):
    a = analyze(load(pp_trace), detail=True)
    pl = a.main.parallel["pp"]
    page = _page(a)
    assert {"pipeline", "vis-pipeline"} <= page.ids and "tensor-parallel" not in page.ids
    stages = page.tables["pipeline-stages"][1:]
    assert [r[1] for r in stages] == ["0", "1"]
    wi = page.tables["pipeline-what-if"][1:]
    assert [r[0] for r in wi] == [w.what for w in pl.what_if]
    # the other schedule is among them (and those with two stages per rank)
    assert {r[1] for r in wi} >= {"GPipe", "1F1B"}
    assert [r[3] for r in wi] == [f"{w.t_iter * 1e3:.1f} ms" for w in pl.what_if]


# -- tensor parallelism ------------------------------------------------------------------


def test_tensor_parallel_section_per_layer_and_degree(tp_trace):
    a = analyze(load(tp_trace), detail=True)
    tp = a.main.dims["tp"]
    chart = {c.id: c for c in charts(a, a.main)}["tensor-parallel"]
    rows = _rows(chart.spec)
    assert len(rows) == len(tp.layers)
    assert chart.spec["encoding"]["y"]["sort"] == [f"layer {k} MLP" for k in range(1, 7)]
    for phase in ("forward", "backward"):      # each phase's exposed time, layer by layer
        got = sum(r["ms"] for r in rows if r["phase"] == phase)
        assert got == pytest.approx(tp.phases[phase]["exposed_s"] * 1e3, rel=1e-3, abs=1e-3)
    assert {r["layer"] for r in rows if r["phase"] == "forward"} == \
        {f"layer {k} MLP" for k in range(1, 7)}
    page = _page(a)
    assert {"tensor-parallel", "vis-tensor-parallel"} <= page.ids
    assert "pipeline" not in page.ids
    wi = page.tables["tp-what-if"][1:]
    assert [r[0] for r in wi] == ["1", "2 (measured)", "4", "8"]
    assert wi[1][2] == "1.00x"
    # degree 1 from 2, the one a 2-rank CPU bench can run, with its measured error from
    # bench/README.md's what-if table beside it (--json's band too); 4 and 8 not validated
    row = next(x for x in (ROOT / "bench" / "README.md").read_text().splitlines()
               if x.startswith("| TP degree |"))
    lo, hi = map(float, re.search(r"(-[\d.]+) \.\. \+([\d.]+) %", row).groups())
    assert wi[0][-1] == f"{lo:+.1f} .. {hi:+.1f} %" and wi[1][-1] == ""
    assert wi[2][-1] == wi[3][-1] == "not validated"
    doc = tp_section(tp)["what_if"]
    assert doc[0]["band"] == pytest.approx([lo / 100, hi / 100])
    assert doc[0]["band_source"] == "bench/whatif_kinds.py" and doc[2]["band"] is None
    assert len(page.tables["tp-layers"]) == len(tp.layers) + 1


def test_a_data_parallel_page_has_no_parallel_sections(tmp_path):
    b = ddp_iterations(Builder(), [([2], 40, 60), ([1], 70, 90)], n=4)
    a = analyze(load(b.write(tmp_path / "t.arrow", world_size=2)), detail=True)
    page = report_html.render(a, None, "", "t.arrow")
    assert 'id="pipeline"' not in page and 'id="tensor-parallel"' not in page
    assert "Pipeline:" not in page and "Tensor parallel:" not in page


# -- export -------------------------------------------------------------------------------


def _chrome(trace: Path, out: Path) -> tuple[list[dict], dict, dict]:
    run_gputrace("export", str(trace), "--format", "chrome", "-o", str(out), check=True)
    ev = json.loads(out.read_text())["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev
               if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in ev
             if e["ph"] == "M" and e["name"] == "process_name"}
    return [e for e in ev if e["ph"] == "X"], threads, procs


def test_export_puts_pipeline_spans_on_a_track_per_rank(pp_trace, tmp_path):
    slices, threads, procs = _chrome(pp_trace, tmp_path / "pp.json")
    want = Counter((r["rank"], r["name"]) for r in load(pp_trace).table.to_pylist()
                   if r["cat"] == "pipeline")
    got: Counter = Counter()
    where = defaultdict(set)
    for e in slices:
        if e["cat"] == "pipeline":
            rank = int(procs[e["pid"]].split()[-1])
            where[rank].add(threads[(e["pid"], e["tid"])])
            got[(rank, e["name"].split()[0])] += 1
            if e["name"].startswith(("forward", "backward")):
                assert e["name"] == f"{e['name'].split()[0]} mb {e['args']['mb']}"
                assert e["args"]["stage"] == rank
            else:
                assert e["name"] == "step (Schedule1F1B)"
                assert e["args"]["microbatches"] == MB and e["args"]["num_stages"] == 2
    assert got == want
    assert where == {0: {"pipeline stage 0"}, 1: {"pipeline stage 1"}}
    # the track holds nothing else
    tracks = {(e["pid"], e["tid"]) for e in slices if e["cat"] == "pipeline"}
    assert {e["cat"] for e in slices if (e["pid"], e["tid"]) in tracks} == {"pipeline"}
    p2p = [e for e in slices if e["cat"] == "comm" and e["args"].get("kind") == "send_recv"]
    assert p2p and all(e["args"]["parallelism"] == "pp" for e in p2p)
    assert {e["args"]["pp_stage"] for e in p2p} == {0, 1}


def test_export_keeps_a_tensor_parallel_collectives_mesh_and_issuer(tp_trace, tmp_path):
    slices, _, _ = _chrome(tp_trace, tmp_path / "tp.json")
    dt = [e for e in slices if e["cat"] == "comm" and e["args"].get("issuer") == "dtensor"]
    assert dt
    for e in dt:
        a = e["args"]
        assert a["parallelism"] == "tp" and a["mesh_dim"] == "tp" and a["mesh_shape"] == "2"
        assert a["functional"] is True and a["call_ns"] >= 0


def test_perfetto_export_has_the_pipeline_tracks(pp_trace, tmp_path):
    pytest.importorskip("perfetto")
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    out = tmp_path / "pp.pftrace"
    run_gputrace("export", str(pp_trace), "-o", str(out), check=True)
    t = Trace()
    t.ParseFromString(out.read_bytes())
    names, begins = {}, Counter()
    args: dict[str, dict] = {}
    for p in t.packet:
        if p.HasField("track_descriptor"):
            names[p.track_descriptor.uuid] = p.track_descriptor.name
        elif p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN:
            ev = p.track_event
            begins[(names[ev.track_uuid], ev.categories[0])] += 1
            if ev.categories[0] == "comm" and ev.name == "comm: send_recv":
                args = {a.name: a for a in ev.debug_annotations}
    n = sum(r["cat"] == "pipeline" for r in load(pp_trace).table.to_pylist()) // 2
    assert begins[("pipeline stage 0", "pipeline")] == n
    assert begins[("pipeline stage 1", "pipeline")] == n
    assert args["parallelism"].string_value == "pp" and "pp_stage" in args
