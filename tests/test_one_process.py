"""What one process's output says, as a newcomer reads it (samples/train_cnn.py recorded as a
user would, no distributed set-up): no communication rows, tables or model line that only
restate the phases, one word of advice to run `gputrace probe`, no GPU hint on a machine
without a GPU, times in ms or s (never 1.46e+03), and one line per event."""

from __future__ import annotations

import ctypes
import html
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import GPUTRACE, run_gputrace
from tests.test_docs import CASE2_UNITS
from tests.tracebuilder import Builder, ddp_iterations

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SAMPLE = str(ROOT / "samples" / "train_cnn.py")
ITERATIONS = 8
SCIENTIFIC = re.compile(r"\d(\.\d+)?e[+-]\d")


def _gpu() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("one")
    times = d / "times.json"
    # a newcomer's machine: no `gputrace probe` run yet (the suite's session cache may hold
    # one that another test of this worker made)
    fresh = {**os.environ, "GPUTRACE_CACHE_DIR": str(d / "no-probe")}
    rec = run_gputrace("record", "-o", str(d / "t.arrow"), "--layers", "leaves", "--",
                       sys.executable, SAMPLE,
                       "--iterations", str(ITERATIONS), "--batch-size", "8", "--workers", "1",
                       "--samples", "128", "--data", str(d / "data"), "--times-json",
                       str(times), cwd=d, check=True, timeout=300, env=fresh)
    text = run_gputrace("analyze", "t.arrow", cwd=d, check=True).stdout
    doc = json.loads(run_gputrace("analyze", "t.arrow", "--json", cwd=d, check=True).stdout)
    run_gputrace("report", "t.arrow", "-o", "r.html", cwd=d, check=True)
    return {"dir": d, "record": rec.stderr, "text": text, "doc": doc, "page": (d / "r.html").read_text(),
            "times": json.loads(times.read_text())}


def test_one_process_has_no_comm_rows_tables_or_restated_model(run):
    text, doc = run["text"], run["doc"]
    assert doc["world_size"] == 1 and doc["breakdown"]["t_comm"]["mean"] == 0
    lines = text.splitlines()
    assert not [ln for ln in lines if ln.split()[:1] == ["t_comm"]], text
    assert "gradient comm" not in text.split("Hidden vs exposed")[1].split("\n\n")[0]
    assert "Gradient units" not in text
    # eq. 1 is the sum of the phases the table gives: a prediction of +0.0 % says nothing
    assert " predicts " not in text, text
    (who,) = [ln for ln in lines if ln.endswith("skipped as warm-up")]
    assert who.startswith(f"one process; {doc['iterations']['analyzed']} iterations "
                          "analyzed"), who
    assert "rank 0 of 1" not in text and "on this process (" in text
    assert "Memory: peak RSS " in text and "Memory (rank" not in text
    assert "on this rank" not in text and "The whole run (" in text, text
    # the job's own iterations, every one of them in the trace
    assert doc["iterations"]["count"] == len(run["times"]) == ITERATIONS


def test_probe_is_advised_once_and_no_gpu_hint_without_a_gpu(run):
    said = [ln for ln in (run["text"]).splitlines() if "gputrace probe" in ln]
    assert len(said) == 1, said
    assert "not distributed" in run["record"].splitlines()[1] or \
        any("not distributed" in ln for ln in run["record"].splitlines()), run["record"]
    if not _gpu():
        assert "gputrace[gpu]" not in run["record"], run["record"]
        assert "no CUDA driver" in run["record"]


def test_times_are_in_ms_or_s_and_reads_in_words(run):
    assert not SCIENTIFIC.search(run["text"]), SCIENTIFIC.search(run["text"])
    assert "forward input" not in run["text"]
    assert "batch from the input of Sequential.forward (torch.float32 [8, " in run["text"]
    # FLOP/s in a unit that puts the figure above 1 on a CPU: GFLOP/s (was 0.000858 TFLOP/s)
    (fl,) = [ln for ln in run["text"].splitlines() if ln.startswith("FLOPs: ")]
    rate = run["doc"]["flops"]["ranks"][str(run["doc"]["flops"]["rank"])]["achieved_flops_per_s"]
    said = re.search(r"GFLOP/iter, ([0-9.]+) (GFLOP/s|TFLOP/s)", fl)
    assert said and float(said[1]) == pytest.approx(
        rate / (1e12 if said[2] == "TFLOP/s" else 1e9), rel=5e-3), fl
    assert (said[2] == "TFLOP/s") == (rate >= 1e12), fl
    bw = [ln for ln in run["text"].splitlines() if ln.startswith("Bandwidth:")]
    for part in bw[0].removeprefix("Bandwidth: ").split("; ") if bw else []:
        # a figure that shows: never "0.0 MB" nor "0 MB/s"
        assert " 0.0 MB " not in part and not part.endswith(" 0 MB/s of loading"), part
        if "cache" in part:
            assert part.startswith("page-cache reads (files already in memory) "), part


def test_one_capture_is_one_line_however_many_processes_noted_it(tmp_path):
    """A window opened on demand in a job with a DataLoader worker: the worker notes the
    window as its rank's main process does; the analysis names it once."""
    env = {**os.environ, "GPUTRACE_RUN_DIR": str(tmp_path / "run")}
    rec = subprocess.Popen(
        [*GPUTRACE, "record", "-q", "-o", "od.arrow", "--on-demand", "--", sys.executable,
         SAMPLE, "--iterations", "40", "--batch-size", "8", "--workers", "2", "--samples",
         "128", "--image-size", "32", "--data", str(tmp_path / "data")], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            p = run_gputrace("capture", str(rec.pid), "--steps", "3", env=env)
            if p.returncode == 0 or rec.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert p.returncode == 0, p.stderr
        # in words: 'iterations', '1 process' or 'N processes' (was 'iteration(s)')
        said = re.fullmatch(r"window of 3 iterations from step (\d+) on (1 process|[2-9] "
                            r"processes) of \S+ \(record pid \d+\)\n", p.stdout)
        assert said, p.stdout
        asked = {"start": int(said[1])}
    finally:
        _, err = rec.communicate(timeout=300)
    assert rec.returncode == 0, err[-2000:]
    doc = json.loads(run_gputrace("analyze", "od.arrow", "--json", cwd=tmp_path,
                                  check=True).stdout)
    assert [c["count"] for c in doc["window"]["captured"]] == [3], doc["window"]
    text = run_gputrace("analyze", "od.arrow", cwd=tmp_path, check=True).stdout
    (line,) = [ln for ln in text.splitlines() if "opened on demand:" in ln]
    assert line.strip() == f"opened on demand: 3 from step {asked['start']}", line
    # the run's series (a windowed trace's goodput table is "The whole run (... s on ...)")
    (run,) = [ln for ln in text.splitlines() if ln.startswith("The whole run:")]
    assert run.startswith("The whole run: 40 iterations; window on demand: 3 iterations"), run
    assert not SCIENTIFIC.search(text), SCIENTIFIC.search(text)


def test_the_report_says_why_a_chart_is_not_drawn_as_the_terminal_does(run):
    (said,) = [ln for ln in run["text"].splitlines()
               if ln.startswith("Predicted speedup: not computed (")]
    why = said.removeprefix("Predicted speedup: not computed (").removesuffix(")")
    assert f"<li>Speedup vs GPU count: {html.escape(why)}</li>" in run["page"]
    # and the page, like the terminal, has no comm row, restated model or "rank 0 of 1"
    summary = run["page"].split('<p class="headline">')[1].split("</table>")[0]
    assert "one process &middot;" in summary and "rank 0 of 1" not in summary, summary
    assert " predicts " not in summary and "<td>t_comm</td>" not in summary, summary
    # nor a rank in the charts' titles and captions: 'of the run's', as the terminal says
    words = re.sub(r"<[^>]+>", " ", re.sub(r"<(script|style)\b.*?</\1>", "", run["page"],
                                           flags=re.S))
    assert not re.search(r"\brank 0\b", words), re.findall(r".{0,60}\brank 0\b.{0,20}", words)
    assert not SCIENTIFIC.search(words), SCIENTIFIC.search(words)
    assert html.escape("Where each iteration's time goes") + "</h2>" in run["page"]


def test_the_report_advises_probe_once_where_the_terminal_does(run, tmp_path):
    """No probe on this machine: the page's bandwidth and FLOPs captions say there is no
    peak, and the advice to run `gputrace probe` is given once, in the speedup's reason as
    the terminal gives it. With a link bandwidth the speedup is computed: the advice moves
    where the terminal's goes, the bandwidth caption where the terminal shows a bandwidth
    line, else the FLOPs caption, still once."""
    def said(page: str) -> list[str]:   # the page's texts between its tags that say it
        # (not a regex of [^<>]* around it: quadratic over the page's scripts, 6 s a page)
        return [s for s in re.split(r"[<>]", page) if "gputrace probe" in s]

    (advice,) = said(run["page"])
    assert advice.startswith("Speedup vs GPU count: "), advice
    assert "no probed peaks in this trace" in run["page"]
    assert "achieved TFLOP/s (no peak known)" in run["page"]
    d = run["dir"]
    run_gputrace("analyze", "t.arrow", "--link-bandwidth", "1GB/s", "--report", "l.html",
                 cwd=d, check=True)
    text = run_gputrace("analyze", "t.arrow", "--link-bandwidth", "1GB/s", cwd=d,
                        check=True).stdout
    (terminal,) = [ln for ln in text.splitlines() if "gputrace probe" in ln]
    (advice,) = said((d / "l.html").read_text())
    if "no peaks to compare with" in terminal:     # a file read the bandwidth line shows
        assert advice.startswith("One panel per kind of link") and \
            "no probed peaks in this trace: run `gputrace probe`" in advice, advice
    else:
        assert terminal.startswith("FLOPs: ") and "no peak known: run gputrace probe" in \
            advice, (terminal, advice)


def test_what_if_rows_have_labels_that_tell_them_apart(run, tmp_path):
    """With a link given, one process's what-if replays DDP's default buckets (1 MiB first,
    then 25) beside bucket_cap_mb=25 (no small first bucket): two rows, two labels."""
    d = run["dir"]
    text = run_gputrace("analyze", "t.arrow", "--link-bandwidth", "1e9", cwd=d,
                        check=True).stdout
    table = text.split("What if: t_iter from a replay")[1].split("\n")[2:]
    # the grid's rows: a label, then a column of 'N ms' (or 'withheld') per GPU count
    labels = [re.split(r"\s{2,}", ln.strip())[0] for ln in table
              if re.match(r"  \S.*?\s{2,}(\d[\d,.]* ms\*?|withheld)(\s|$)", ln)]
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
    assert any(x.startswith("DDP's default (1 MiB first, then 25)") for x in labels), labels
    # each row's bucket count in words (was a bare '(1)' after the label)
    assert all(re.search(r": \d+ buckets?$", x) for x in labels if x != "one bucket"), labels
    assert not [ln for ln in text.splitlines() if ln.startswith("  2 GPUs, measured buckets")]
    # nothing to replay in one process's measured configuration: no '+0.0%' check of it
    assert "replaying the measured configuration" not in text
    assert "each prediction is the measured iteration plus the replayed change" in text


def test_a_layer_has_one_name_in_the_terminal_diff_and_report(run):
    """Each layer by its module path (the FLOP count's, as --json gives it) and its class:
    the same words in `diff`, the report's timeline and --json."""
    layers = run["doc"]["flops"]["layers"]
    assert len(layers) == 5 and all(ly["module"].startswith("Sequential.") for ly in layers)
    names = {f"{ly['layer']} {ly['module']} ({ly['name']})" for ly in layers}
    doc = json.loads(run_gputrace("diff", "t.arrow", "t.arrow", "--json", cwd=run["dir"],
                                  check=True).stdout)
    assert {r["name"] for r in doc["layers"]["backward"]["top"]} <= names
    assert doc["layers"]["backward"]["top"]
    # the timeline's lanes, in the page's data
    assert all(f'"layer {n}"' in run["page"] for n in names), names


def test_diff_of_one_process_restates_no_model(run, tmp_path):
    """Two runs of one process: the model's t_iter is the sum of the phases the diff's table
    gives, so no model section; a run with comm units keeps it."""
    text = run_gputrace("diff", "t.arrow", "t.arrow", cwd=run["dir"], check=True).stdout
    assert "t_iter" in text and "predicted t_iter" not in text and "Model," not in text, text
    assert not SCIENTIFIC.search(text), SCIENTIFIC.search(text)
    ddp_iterations(Builder(), CASE2_UNITS, n=8).write(tmp_path / "ddp.arrow", world_size=1)
    text = run_gputrace("diff", "ddp.arrow", "ddp.arrow", cwd=tmp_path, check=True).stdout
    assert "Model, before -> after" in text and "predicted t_iter" in text, text


def test_the_diff_page_says_what_the_terminal_does(run, tmp_path):
    """The diff page of one process's run against a run whose layers are others (a built
    trace of 4 layers and 4 comm units): its reasons for not drawing the layers and units
    count what each side has, as the terminal's 'Not comparable' line (the layers were 'no
    per-layer backward spans in both runs' where both had some), and its summary names
    one process and its iterations as the terminal does."""
    ddp_iterations(Builder(), CASE2_UNITS, n=8).write(tmp_path / "ddp.arrow", world_size=1)
    t = str(run["dir"] / "t.arrow")
    text = run_gputrace("diff", t, "ddp.arrow", "--report", "d.html", cwd=tmp_path,
                        check=True).stdout
    page = (tmp_path / "d.html").read_text()
    (said,) = [ln for ln in text.splitlines() if ln.startswith("Not comparable: ")]
    assert "layers do not match (5 only before, 4 only after, 0 in both)" in said, said
    assert "comm units do not match (0 only before, 4 only after, 0 in both)" in said, said
    assert "<li>Layers, backward: no layer in both runs (5 only before, 4 only after)</li>" \
        in page
    assert "<li>Comm units: no comm unit in both runs (0 only before, 4 only after)</li>" \
        in page
    assert "<li>Layers, forward: no per-layer forward spans in either run</li>" in page
    n = run["doc"]["iterations"]["analyzed"]
    assert f"before: {t} (one process, {n} iterations analyzed)" in page, \
        re.findall(r'<p class="meta">.{0,200}', page)
    # the page's one-process side names no rank
    assert "One iteration before, as a timeline: iteration " in page
    assert not re.search(r"One iteration (before|after), as a timeline[^<]*rank", page)


def test_export_to_a_json_name_writes_json_and_names_the_process(run, tmp_path):
    """`export -o run.json` without --format: a file named .json holds the Trace Event
    JSON that chrome://tracing and Perfetto open (it held Perfetto's protobuf), and the
    process's track is named as record's summary names it, not 'no rank'."""
    p = run_gputrace("export", str(run["dir"] / "t.arrow"), "-o", "run.json", cwd=tmp_path,
                     check=True)
    assert p.stdout.startswith("run.json: "), p.stdout
    events = json.loads((tmp_path / "run.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"process (not distributed)"}, names
    # the job's own iterations, each a slice on the timeline
    assert len([e for e in events if e.get("ph") == "X" and e.get("name") == "iteration"]) \
        == len(run["times"]), sorted({e.get("name") for e in events})[:40]


def test_long_module_paths_keep_their_last_parts():
    from gputrace.analyzers.core.layer_names import label, short

    assert short("Sequential.0") == "Sequential.0"
    assert short("ResNetish.layer3.short.0") == "ResNetish.layer3.short.0"
    assert short("GPT.transformer.h.11.attn.c_attn") == "…11.attn.c_attn"
    assert label(17, "Conv2d", "ResNetish.layer3.short.0") == \
        "17 ResNetish.layer3.short.0 (Conv2d)"
    assert label(3, "Linear") == "3 Linear"
