"""samples/analysis.ipynb executed by a real Jupyter kernel (nbclient): its breakdown table
holds `analyze --json`'s figures, its chart the report's spec, its query the trace's own
rows; its HTML (nbconvert, the offline template in samples/nbconvert) opened in Chromium
draws the chart with no console error and no network request."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gputrace.trace import load
from tests.conftest import run_gputrace
from tests.test_report import STACK, browser, open_in_browser  # noqa: F401 - a fixture
from tests.test_sql import top_kernels

for extra in ("nbclient", "nbformat", "ipykernel", "nbconvert", "pandas", "duckdb",
              "vl_convert"):
    pytest.importorskip(extra, reason=f"{extra} is not installed (pip install -e "
                        "'.[notebook,report]')")
import nbformat  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"

PROBE = """import json
print(json.dumps({"breakdown": breakdown.to_dict("records"),
                  "top": [list(r) for r in top.itertuples(index=False)]}))"""


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook run top to bottom in a fresh kernel, on a trace it writes itself; then
    one more cell (not kept) prints the DataFrames it made as JSON."""
    d = tmp_path_factory.mktemp("notebook")
    trace = d / "sample.arrow"
    nb = nbformat.read(SAMPLES / "analysis.ipynb", as_version=4)
    old = os.environ.get("GPUTRACE_SAMPLE_TRACE")
    os.environ["GPUTRACE_SAMPLE_TRACE"] = str(trace)
    try:
        client = NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(SAMPLES)}})
        with client.setup_kernel():
            for i, cell in enumerate(nb.cells):
                client.execute_cell(cell, i)
            nb.cells.append(nbformat.v4.new_code_cell(PROBE))
            client.execute_cell(nb.cells[-1], len(nb.cells) - 1)
    finally:
        if old is None:
            os.environ.pop("GPUTRACE_SAMPLE_TRACE", None)
        else:
            os.environ["GPUTRACE_SAMPLE_TRACE"] = old
    probe = json.loads("".join(o["text"] for o in nb.cells.pop()["outputs"]
                               if o.get("name") == "stdout"))
    return nb, trace, probe, d


def outputs(nb, source_start: str) -> list[dict]:
    cell = next(c for c in nb.cells if c.cell_type == "code" and
                c.source.startswith(source_start))
    return cell["outputs"]


def test_executed_notebook_shows_what_analyze_json_says(executed):
    nb, trace, probe, _ = executed
    assert trace.exists()                    # written by the notebook, nothing recorded
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c["outputs"]
              if o["output_type"] == "error"]
    assert errors == []
    doc = json.loads(run_gputrace("analyze", str(trace), "--json", check=True).stdout)
    # the breakdown DataFrame: shown as a table, and its values are the JSON's
    shown = outputs(nb, "breakdown = ")[0]["data"]
    assert "<table" in shown["text/html"]
    for term in doc["breakdown"]:
        assert f"<td>{term}</td>" in shown["text/html"] or f">{term}<" in shown["text/html"]
    assert probe["breakdown"] == [{"term": k, "mean": v["mean"], "std": v["std"]}
                                  for k, v in doc["breakdown"].items()]
    # the chart: the report's Vega-Lite spec of this analysis, with Vega inline
    import gputrace
    from gputrace.report.charts import charts

    r = gputrace.analyze(trace)
    spec = next(c.spec for c in charts(r.analysis, r.shown) if c.id == "breakdown")
    html = outputs(nb, 'r.chart("breakdown")')[0]["data"]["text/html"]
    assert json.dumps(spec, separators=(",", ":")).replace("</", "<\\/") in html
    assert "window.vegaEmbed=" in html and "<script src" not in html
    # the query: the five costliest kernels per phase, from the trace's own rows
    want = top_kernels(load(trace).table.to_pylist())
    assert [(p, n, c, pytest.approx(s, rel=1e-12)) for p, n, c, s, _ in probe["top"]] == want
    phases = [p for p, *_ in want]
    assert all(phases.count(p) == 5 for p in ("forward", "backward", "update"))


def test_executed_notebook_html_in_chromium(executed, browser):  # noqa: F811
    from nbconvert import HTMLExporter

    nb, _, _, d = executed
    exporter = HTMLExporter(extra_template_basedirs=[str(SAMPLES / "nbconvert")],
                            template_name="offline")
    body, _ = exporter.from_notebook_node(nb)
    assert "cdnjs" not in body and "<script src" not in body
    page_path = d / "analysis.html"
    page_path.write_text(body, encoding="utf-8")
    # no console error or warning, no request but the page's own, every chart drawn
    state, page = open_in_browser(browser, page_path, d / "shots")
    assert len(state) == 1
    (chart,) = state.values()
    assert chart["colour"] == STACK and chart["items"]["layer_0_marks"] > 0
    page.close()
