"""Throughput: samples (and tokens) per second from the batch the job feeds its model,
against the job's own count of the samples it fed and its own perf_counter per iteration
(tests/jobs/throughput_train.py): a token model called as `model(input_ids=...)` with
gradient accumulation, in one process, and an MLP under DDP over gloo, whose job figure is
the sum over its replicas."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_gputrace

JOB = Path(__file__).resolve().parent / "jobs" / "throughput_train.py"
SKIP = 3           # warm-up iterations left out, by the analysis and by the job's own figure
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
                 str(prefix), "--acc", "1", "--hold-mb", "300", "--hold-rank", "1", check=True,
                 timeout=300)
    return prefix, arrow


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


def test_ddp_job_throughput_is_the_sum_over_its_replicas(ddp):
    """2 ranks of DDP, each feeding its own 32 samples per iteration: each rank's samples/s
    within 5 % of its own clock's, and the job's the sum of the ranks' own (2 replicas)."""
    prefix, arrow = ddp
    doc = analyze(arrow)
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
    import gputrace

    rows = {r["rank"]: r for r in gputrace.analyze(arrow, skip=SKIP).table(
        "throughput").records()}
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


def test_memory_per_rank_as_each_rank_measures_its_own(ddp):
    """Rank 1 holds 300 MiB more than rank 0: each rank's peak resident set within 10 % of
    the one it measured itself at its end (a peak only rises), rank 1 named the largest,
    and the terminal says both."""
    prefix, arrow = ddp
    m = analyze(arrow)["memory"]
    assert m["unavailable"] is None
    own = {r: json.loads(Path(f"{prefix}.rank{r}.json").read_text())["rss_peak_bytes"]
           for r in (0, 1)}
    for r in (0, 1):
        got = m["ranks"][str(r)]["rss_peak_bytes"]
        assert own[r] * 0.99 <= got <= own[r] * 1.10, (r, got, own[r])
    assert own[1] - own[0] > 250 * 2**20     # the job's own difference: the held tensor
    assert m["largest_rank"] == 1
    text = run_gputrace("analyze", arrow, "--rank", "0", check=True).stdout
    assert "Memory (rank 0): peak RSS" in text and "largest on rank 1" in text, text[-600:]
