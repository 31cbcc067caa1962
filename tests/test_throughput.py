"""Throughput: samples (and tokens) per second from the batch the job feeds its model,
against the job's own count of the samples it fed and its own perf_counter per iteration
(tests/jobs/throughput_train.py): a token model called as `model(input_ids=...)` with
gradient accumulation, in one process, and an MLP under DDP over gloo, whose job figure is
the sum over its replicas. Memory per rank on the same DDP job, whose rank 1 allocates 512 MiB
in the forward pass of one iteration and holds them until its optimizer step, against what
each rank read of its own resident set there, and a balanced DDP job beside it."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_gputrace

JOB = Path(__file__).resolve().parent / "jobs" / "throughput_train.py"
BALANCED = Path(__file__).resolve().parent / "jobs" / "phase_ranks.py"
SKIP = 3           # warm-up iterations left out, by the analysis and by the job's own figure
SPIKE_MIB, SPIKE_STEP = 512, 5
TOL = 0.05


def own(prefix: Path, rank: int) -> tuple[float, dict]:
    """The job's own samples per second over the analyzed iterations, and its record."""
    t = json.loads(Path(f"{prefix}.rank{rank}.json").read_text())
    return t["samples"] / float(np.mean(t["iterations"][SKIP:])), t


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    d = tmp_path_factory.mktemp("tput")
    prefix, arrow = d / "tok", str(d / "tok.arrow")
    run_gputrace("record", "-q", "-o", arrow, "--", sys.executable, str(JOB), str(prefix),
                 "--tokens", "--acc", "2", check=True, timeout=300)
    return prefix, arrow


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    d = tmp_path_factory.mktemp("tput-ddp")
    prefix, arrow = d / "ddp", str(d / "ddp.arrow")
    run_gputrace("record", "-q", "-o", arrow, "--", sys.executable, "-m",
                 "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB),
                 str(prefix), "--acc", "1", "--spike-mb", str(SPIKE_MIB), "--spike-rank", "1",
                 "--spike-step", str(SPIKE_STEP), check=True, timeout=300)
    return prefix, arrow


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    """Two ranks alike (tests/jobs/phase_ranks.py: gputrace phases, no framework, each rank
    holding the same in its forward), launched side by side with RANK and WORLD_SIZE."""
    arrow = str(tmp_path_factory.mktemp("tput-bal") / "bal.arrow")
    job = f"{shlex.quote(sys.executable)} {shlex.quote(str(BALANCED))}"
    run_gputrace("record", "-q", "-o", arrow, "--collectors", "host", "--", "sh", "-c",
                 f"RANK=0 WORLD_SIZE=2 {job} & RANK=1 WORLD_SIZE=2 {job}; wait",
                 check=True, timeout=120)
    return arrow


def analyze(arrow: str, *extra: str) -> dict:
    return json.loads(run_gputrace("analyze", arrow, "--json", "--skip", str(SKIP), *extra,
                                   check=True).stdout)


def test_token_model_samples_and_tokens_per_second_as_the_job_counts_them(tokens):
    """`model(input_ids=ids)`, 2 micro-batches of 32 x 32 token ids per iteration: 64
    samples and 2,048 tokens per iteration, per second within 5 % of the job's own; the
    batch said to come from the model's input_ids; the headline and the line under Table V
    give it."""
    prefix, arrow = tokens
    want, t = own(prefix, 0)
    tp = analyze(arrow)["throughput"]
    assert tp["forwards_per_iteration"] == pytest.approx(2)
    assert tp["samples_per_iteration"] == pytest.approx(t["samples"])
    assert tp["tokens_per_sample"] == t["tokens_per_sample"]
    assert abs(tp["samples_per_s"] / want - 1) <= TOL, (tp["samples_per_s"], want)
    assert tp["tokens_per_s"] == pytest.approx(tp["samples_per_s"] * t["tokens_per_sample"])
    assert "input_ids" in tp["source"] and "torch.int64" in tp["source"]
    text = run_gputrace("analyze", arrow, "--skip", str(SKIP), check=True).stdout
    head = text.splitlines()[0]
    assert "samples/s)" in head, head
    (line,) = [ln for ln in text.splitlines() if ln.startswith("throughput:")]
    assert "tokens/s" in line and "2 forwards of 32" in line, line


def test_batch_size_option_replaces_the_batch_and_bad_values_are_one_line(tokens):
    """--batch-size gives the samples per forward (the forwards still counted);
    --tokens-per-sample the tokens; 0 is refused with one line and exit 2."""
    _, arrow = tokens
    tp = analyze(arrow, "--batch-size", "10", "--tokens-per-sample", "5")["throughput"]
    assert tp["samples_per_iteration"] == pytest.approx(20)
    assert tp["tokens_per_sample"] == 5 and tp["source"] == "--batch-size"
    p = run_gputrace("analyze", arrow, "--batch-size", "0")
    assert p.returncode == 2 and "--batch-size" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_ddp_job_throughput_is_the_sum_over_its_replicas(ddp, ddp_doc, ddp_api):
    """2 ranks of DDP, each feeding its own 32 samples per iteration: each rank's samples/s
    within 5 % of its own clock's, and the job's the sum of the ranks' own (2 replicas)."""
    prefix, arrow = ddp
    doc = ddp_doc
    total = 0.0
    for r in (0, 1):
        want, t = own(prefix, r)
        tp = doc["ranks"][str(r)]["throughput"]
        assert tp["samples_per_iteration"] == pytest.approx(t["samples"])
        assert tp["tokens_per_sample"] is None
        assert abs(tp["samples_per_s"] / want - 1) <= TOL, (r, tp["samples_per_s"], want)
        total += want
    job = doc["throughput"]["job"]
    assert job["replicas"] == 2 and job["ranks"] == 2
    assert abs(job["samples_per_s"] / total - 1) <= TOL, (job, total)
    # the Python API's table: a row per rank and the job's (rank None), as --json
    rows = {r["rank"]: r for r in ddp_api.table("throughput").records()}
    assert set(rows) == {0, 1, None}
    assert rows[None]["samples_per_s"] == pytest.approx(job["samples_per_s"])
    assert rows[0]["samples_per_s"] == pytest.approx(doc["ranks"]["0"]["throughput"][
        "samples_per_s"])


def test_window_that_starts_later_keeps_the_batch_and_the_whole_run(tmp_path):
    """One process recorded with `--steps 3:4`: the input was described at the first
    forward, outside the window, and the throughput still holds the job's own batch; the
    whole run's iterations are the job's count (a single process records rank -1, which
    the analysis calls 0)."""
    prefix, arrow = tmp_path / "win", str(tmp_path / "win.arrow")
    run_gputrace("record", "-q", "-o", arrow, "--steps", "3:4", "--", sys.executable,
                 str(JOB), str(prefix), "--iterations", "8", check=True, timeout=300)
    t = json.loads(Path(f"{prefix}.rank0.json").read_text())
    d = json.loads(run_gputrace("analyze", arrow, "--json", "--skip", "0",
                                check=True).stdout)
    assert d["window"]["iterations"] == 4 and d["window"]["first_step"] == 3
    assert d["run"]["iterations"] == len(t["iterations"])
    assert d["throughput"]["samples_per_iteration"] == t["samples"], d["throughput"]


@pytest.fixture(scope="module")
def ddp_doc(ddp):
    """analyze --json of the DDP job, shared by the tests that read it."""
    return analyze(ddp[1])


@pytest.fixture(scope="module")
def ddp_api(ddp):
    """gputrace.analyze(...) of the DDP job, shared by the tests that read it."""
    import gputrace

    return gputrace.analyze(ddp[1], skip=SKIP)


def test_memory_per_rank_as_each_rank_measures_its_own(ddp, ddp_doc):
    """Rank 1 holds 512 MiB more than rank 0 for one iteration: each rank's peak resident
    set within 10 % of the one it measured itself at its end (a peak only rises), rank 1
    named the largest, and the terminal says both, with the phase of rank 0's peak and the
    finding of rank 1's."""
    prefix, arrow = ddp
    m = ddp_doc["memory"]
    assert m["unavailable"] is None
    own = {r: json.loads(Path(f"{prefix}.rank{r}.json").read_text())["rss_peak_bytes"]
           for r in (0, 1)}
    for r in (0, 1):
        got = m["ranks"][str(r)]["rss_peak_bytes"]
        assert own[r] * 0.99 <= got <= own[r] * 1.10, (r, got, own[r])
    assert own[1] - own[0] > 250 * 2**20     # the job's own difference: the held tensor
    assert m["largest_rank"] == 1
    text = run_gputrace("analyze", arrow, "--rank", "0", check=True).stdout
    phase = m["ranks"]["0"]["rss_peak_phase"]
    assert phase and "Memory (rank 0): peak RSS " in text, text[-800:]
    assert f" GiB in {phase}; " in text and "largest on rank 1" in text, text[-800:]
    assert "moderate  Rank 1 peaked at " in text, text[-800:]


def test_memory_peak_and_its_phase_as_each_rank_reads_them(ddp, ddp_doc):
    """In iteration 5 each rank read its own resident set (/proc/self/statm) in the forward
    pass, rank 1 after allocating and writing 512 MiB it holds until its optimizer step:
    each rank's forward peak within 10 % of its own reading, rank 1's peak too and named as
    happened in forward."""
    prefix, _ = ddp
    own = {r: json.loads(Path(f"{prefix}.rank{r}.json").read_text())["spike_rss_bytes"]
           for r in (0, 1)}
    assert own[1] - own[0] > 0.8 * SPIKE_MIB * 2**20, own    # the job's own: the spike
    m = ddp_doc["memory"]
    for r in (0, 1):
        got = m["ranks"][str(r)]["phases"]["forward"]["rss_peak_bytes"]
        assert abs(got - own[r]) <= 0.10 * own[r], (r, got, own[r])
    one = m["ranks"]["1"]
    assert abs(one["rss_peak_bytes"] - own[1]) <= 0.10 * own[1], (one, own[1])
    assert one["rss_peak_phase"] == "forward", one
    shown = m["ranks"][str(ddp_doc["slowest_rank"])]
    assert m["phases"] == shown["phases"] and m["rss_peak_phase"] == shown["rss_peak_phase"]
    assert m["host_total_bytes"] > own[1]


def test_memory_findings_name_the_rank_that_holds_far_more(ddp_doc, balanced):
    """The spiking job has one `memory_imbalance` finding, of rank 1 with its figures and
    the phase; a balanced job of two ranks none."""
    found = [f for f in ddp_doc["findings"] if f["id"] == "memory_imbalance"]
    assert len(found) == 1 and found[0]["message"].startswith("Rank 1 peaked at "), found
    ranks = ddp_doc["memory"]["ranks"]
    ratio = ranks["1"]["rss_peak_bytes"] / ranks["0"]["rss_peak_bytes"]
    assert f"(in forward), {ratio:.1f}x the median" in found[0]["message"], found
    b = analyze(balanced)
    assert set(b["memory"]["ranks"]) == {"0", "1"}
    assert {v["rss_peak_phase"] for v in b["memory"]["ranks"].values()} == {"forward"}
    assert not [f for f in b["findings"] if f["id"].startswith("memory_")], b["findings"]


def test_memory_table_and_chart_of_the_api(ddp_api):
    """gputrace.analyze(...).table("memory") says what the JSON says, per rank and phase;
    the memory chart draws the shown rank's median iteration with its phases shaded."""
    m = ddp_api.to_dict()["memory"]
    rows = ddp_api.table("memory").records()
    for rk in ("0", "1"):
        v = m["ranks"][rk]
        mine = {x["phase"]: x for x in rows if x["rank"] == int(rk)}
        assert mine[None]["rss_peak_bytes"] == v["rss_peak_bytes"]
        assert {p: x["rss_peak_bytes"] for p, x in mine.items() if p} == \
            {p: x["rss_peak_bytes"] for p, x in v["phases"].items()}
    assert [x["phase"] for x in rows if x["rank"] == 1 and x["rss_peak_here"]] == ["forward"]
    assert "memory" in ddp_api.chart_ids
    spec = ddp_api.chart("memory").spec
    shaded = set(spec["layer"][0]["data"]["values"][0]["phase"])
    assert {"forward", "backward", "update"} <= shaded
    line = spec["layer"][1]["data"]["values"][0]
    assert set(line["series"]) == {"host RSS"} and len(line["v"]) >= 6
