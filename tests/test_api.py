"""`gputrace.analyze` from Python: the same document `analyze --json` prints (checked as text,
on a recorded 2-rank DDP run, traces other tools made and built traces), its tables equal to
the document's figures, charts and the report for Jupyter, and optional extras that stay
optional."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import gputrace
from tests.conftest import run_gputrace
from tests.test_report import CASE2_UNITS, torchrun
from tests.tracebuilder import Builder, ddp_iterations

ROOT = Path(__file__).resolve().parents[1]


def cli_json(*args: str) -> str:
    return run_gputrace("analyze", *args, "--json", check=True).stdout


def two_ranks(path: Path) -> Path:
    """Two ranks of Case 2 DDP, rank 1 waiting 3 ms more for data (the slower)."""
    b = ddp_iterations(Builder(), CASE2_UNITS, n=8)
    ddp_iterations(b, CASE2_UNITS, n=8, rank=1, wait=3)
    return b.write_by_rank(path, world_size=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return two_ranks(tmp_path_factory.mktemp("api") / "two.arrow")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A real 2-rank gloo DDP run of samples/train_cnn.py, recorded once for the module."""
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("rec")
    trace = d / "run.arrow"
    run_gputrace("record", "-o", str(trace), "--",
                 *torchrun("--preset", "case2", "--iterations", "8", "--data", str(d / "data")),
                 timeout=600, check=True)
    return trace


def check_tables(r: gputrace.Result, doc: dict) -> None:
    """Every table says what the document says."""
    bd = r.to_pandas("breakdown")
    assert list(bd.term) == list(doc["breakdown"])
    assert list(bd["mean"]) == [v["mean"] for v in doc["breakdown"].values()]
    assert list(bd["std"]) == [v["std"] for v in doc["breakdown"].values()]
    units = r.to_pandas("units")
    for rank, rd in doc["ranks"].items():
        mine = units[units["rank"] == int(rank)]
        assert list(mine["index"]) == [u["index"] for u in rd["units"]]
        assert list(mine["end_s"]) == [u["end_s"] for u in rd["units"]]
        assert list(mine["hidden"]) == [u["hidden"] for u in rd["units"]]
    ranks = r.to_pandas("ranks").set_index("rank")
    for rank, rd in doc["ranks"].items():
        assert ranks.loc[int(rank), "t_iter"] == rd["breakdown"]["t_iter"]["mean"]
        assert ranks.loc[int(rank), "comm_exposed_s"] == rd["overlap"]["comm"]["exposed_s"]
    assert ranks["slowest"].idxmax() == doc["slowest_rank"]
    f = r.to_pandas("findings")
    assert list(f[f["rank"] == doc["rank"]].id) == [x["id"] for x in doc["findings"]]
    sp = r.to_pandas("speedup")
    assert list(sp.gpus) == [p["gpus"] for p in doc["speedup"]["points"]]
    wi = r.to_pandas("what_if")
    # a withheld scenario: NaN in the table, null in the document
    assert [None if x != x else x for x in wi.t_iter] == \
        [s["t_iter"] for s in (doc["what_if"] or {}).get("scenarios", [])]
    # the per-iteration table's analyzed rows average to the document's breakdown
    it = r.to_pandas("iterations")
    for rank, rd in doc["ranks"].items():
        rows = it[(it["rank"] == int(rank)) & ~it["warmup"] & ~it["flops_left_out"]]
        assert len(rows) == rd["iterations"]["analyzed"]
        assert (it["rank"] == int(rank)).sum() == rd["iterations"]["count"]
        for term, stat in rd["breakdown"].items():
            assert rows[term].mean() == pytest.approx(stat["mean"], rel=1e-9, abs=1e-12), term


def test_built_trace_same_as_json_and_tables(built):
    pytest.importorskip("pandas")
    r = gputrace.analyze(built)
    text = cli_json(str(built))
    assert r.to_json() + "\n" == text            # the one serializer, to the character
    doc = json.loads(text)
    assert r.to_dict() == doc
    assert r.rank == doc["rank"] == 1 == r.slowest_rank
    assert isinstance(r.analysis, gputrace.api.Analysis) and r.model is r.shown.model
    assert [u.end_s for u in r.units] == [u["end_s"] for u in doc["units"]]
    check_tables(r, doc)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.rank = 0


def test_show_prints_what_analyze_prints(built):
    """`Result.show()` prints every section `gputrace analyze` prints (the terminal renderer
    owns them all), in another process with the same environment."""
    code = f"import gputrace; gputrace.analyze({str(built)!r}, rank=0).show()"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, check=True).stdout
    printed = run_gputrace("analyze", str(built), "--rank", "0", check=True).stdout
    assert shown == printed
    assert "Where an iteration's time goes" in shown


def test_options_are_the_command_lines(built):
    r = gputrace.analyze([built], rank=0, skip=2, gpus=[2, 8], link_bandwidth=2.5e9,
                         what_if=["gpus=8,bandwidth=2x", "bucket_cap_mb=1"])
    assert r.to_json() + "\n" == cli_json(str(built), "--rank", "0", "--skip", "2", "--gpus",
                                          "2,8", "--link-bandwidth", "2.5GB/s", "--what-if",
                                          "gpus=8,bandwidth=2x", "--what-if", "bucket_cap_mb=1")
    doc = r.to_dict()
    assert doc["rank"] == 0 and doc["iterations"]["warmup_skipped"] == 2
    labels = [s["label"] for s in doc["what_if"]["scenarios"]]
    assert "8 GPUs, measured buckets, link x2" in labels


def test_ranks_in_an_executor_give_the_same(built):
    with ThreadPoolExecutor(2) as ex:
        r = gputrace.analyze(str(built), executor=ex)
    assert r.to_dict() == gputrace.analyze(str(built), jobs=1).to_dict()


def test_bad_input_is_the_command_lines_one_line(tmp_path, built):
    missing = tmp_path / "missing.arrow"
    p = run_gputrace("analyze", str(missing))
    with pytest.raises(gputrace.AnalysisError) as e:
        gputrace.analyze(missing)
    assert p.stderr.strip() == f"gputrace: error: {e.value}"
    for kw, says in (({"rank": 7}, "no rank 7"), ({"gpus": [0]}, "--gpus"),
                     ({"what_if": "gpus=x"}, "--what-if"), ({"link_bandwidth": -1}, "--link-bandwidth")):
        with pytest.raises(gputrace.AnalysisError, match=says):
            gputrace.analyze(built, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["kineto/two_rank", "kineto/nccl_data.json.gz",
                                    "nsys/h100_2gpu_1s.sqlite", "nsys/mfu_2gpu_before.sqlite"])
def test_other_tools_traces_same_as_json(shared_data, source):
    pytest.importorskip("pandas")
    path = str(shared_data / source)
    r = gputrace.analyze(path)
    text = cli_json(path)
    assert r.to_json() + "\n" == text
    check_tables(r, json.loads(text))


@pytest.mark.slow
def test_recorded_ddp_run_same_as_json(recorded):
    pytest.importorskip("pandas")
    r = gputrace.analyze(recorded)
    text = cli_json(str(recorded))
    assert r.to_json() + "\n" == text
    doc = json.loads(text)
    assert doc["world_size"] == 2 and len(doc["units"]) >= 2
    check_tables(r, doc)
    # the job's own iteration count (8) is what the per-iteration table holds per rank
    it = r.to_pandas("iterations")
    assert sorted(it.groupby("rank").size().tolist()) == [8, 8]


def test_charts_hold_the_reports_specs_and_the_report_is_one_call(built):
    pytest.importorskip("vl_convert")
    from gputrace.report.charts import charts

    r = gputrace.analyze(built)
    made = {c.id: c for c in charts(r.analysis, r.shown)}
    assert r.chart_ids == list(made) and "breakdown" in made
    view = r.chart("breakdown")
    assert view.spec == made["breakdown"].spec
    page = view._repr_html_()
    spec = json.dumps(made["breakdown"].spec, separators=(",", ":")).replace("</", "<\\/")
    assert spec in page and "window.vegaEmbed=" in page   # the spec, and Vega inline
    assert "<script src" not in page
    with pytest.raises(KeyError, match="breakdown"):
        r.chart("nonesuch")
    rep = r.report()
    assert rep.html.startswith("<!DOCTYPE html>") and 'id="vis-breakdown"' in rep.html
    assert rep._repr_html_().startswith('<iframe class="gputrace-report" srcdoc="')
    assert "Case 2" in r._repr_html_()


def test_without_pandas_duckdb_or_jupyter_the_core_and_cli_work(built):
    code = (
        "import sys\n"
        "class NotInstalled:\n"        # as if these were not installed
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('pandas', 'polars', 'duckdb', 'IPython',\n"
        "                                      'nbclient', 'nbformat', 'ipykernel'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, NotInstalled())\n"
        "import gputrace\n"
        f"r = gputrace.analyze({str(built)!r})\n"
        "print(r.to_dict()['rank'], len(r.table('units')))\n"
        "for call in (lambda: r.to_pandas('units'), lambda: r.to_polars('units'),\n"
        "             lambda: __import__('gputrace.sql').sql.connect(r.source)):\n"
        "    try:\n"
        "        call()\n"
        "    except gputrace.api.MissingExtra as e:\n"
        "        print(e)\n"
        "from gputrace.cli import main\n"
        f"sys.exit(main(['analyze', {str(built)!r}, '--json']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[:4] == ["1 8", "a DataFrame needs pandas: pip install 'gputrace[notebook]'",
                         "a polars DataFrame needs polars: pip install 'gputrace[polars]'",
                         "SQL over a trace needs duckdb: pip install 'gputrace[notebook]'"]
    assert json.loads("\n".join(lines[4:]))["rank"] == 1
    # importing gputrace (as a training job does) loads none of the analysis
    p = subprocess.run([sys.executable, "-c", "import gputrace, sys; print(sorted(m for m in "
                        "sys.modules if m.startswith(('gputrace.analyzers', 'gputrace.api', "
                        "'pandas', 'duckdb'))))"], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "[]", p.stdout


@pytest.mark.slow
def test_one_analysis_reads_its_trace_once_for_every_reader(recorded, tmp_path, capsys):
    """What is read beside the ranks' analysis (window, memory, FLOPs, hangs) is read once,
    by the analysis, and held in it: with the trace gone after `gputrace.analyze`, the
    document, the printed sections and the report's charts are still those of the trace
    (as `analyze --json` and `analyze` print them from the file)."""
    import shutil

    copy = tmp_path / "run.arrow"
    shutil.copy(recorded, copy)
    r = gputrace.analyze(copy)
    copy.unlink()
    doc, want = r.to_dict(), json.loads(cli_json(str(recorded)))
    for key in ("memory", "flops", "hangs"):
        assert doc[key] == want[key], key
    assert want["memory"]["ranks"] and want["flops"]["layers"]     # something was read
    r.show()
    printed = run_gputrace("analyze", str(recorded), check=True).stdout
    assert capsys.readouterr().out.replace(str(copy), str(recorded)) == printed
    assert {"memory"} <= set(r.chart_ids)
