"""The whole run, not only its iterations: a real training job (tests/jobs/run_phases.py)
times its own steps, validation passes, checkpoints, start-up and wall time, is recorded by
`gputrace record`, and gputrace's steps, evaluation, checkpointing, start-up and goodput are
held to the job's own clocks (10 % or 50 ms; goodput within 2 points)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gputrace import load  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402

JOB = str(Path(__file__).resolve().parent / "jobs" / "run_phases.py")
pytestmark = pytest.mark.slow


def close(got: float, want: float, what: str) -> None:
    """Within 10 % or 50 ms of the job's own clock."""
    assert abs(got - want) <= max(0.10 * want, 0.050), (what, got, want)


def spans(rows: list[dict], cat: str, name: str | None = None, rank: int | None = None
          ) -> list[dict]:
    return sorted((r for r in rows if r["cat"] == cat and (name is None or r["name"] == name)
                   and (rank is None or r["rank"] == rank)), key=lambda r: r["start_ns"])


def job_goodput(t: dict) -> float:
    """The job's own: its training steps' time over its wall time (process start to the
    last line of main)."""
    return sum(s["end"] - s["start"] for s in t["steps"]) / (t["end"] - t["process_start"])


def own_after_step(t: dict, steps: set[int] | None = None) -> float:
    """The job's own time after each step's optimizer step returned to the next thing its
    loop begins (the next step's batch request, a validation pass, a save): its zero_grad,
    logging and whatever else it does there, which nothing records; the last step's none
    (its iteration ends with its step). `steps`: only theirs."""
    starts = [x["start"] for k in ("steps", "evals", "saves") for x in t[k]]
    return sum(min(x for x in starts if x > s["stepped"]) - s["stepped"]
               for s in t["steps"][:-1] if steps is None or s["step"] in steps) / 1e9


def check_rank(rows: list[dict], doc: dict, t: dict, rank: int | None) -> None:
    its = spans(rows, "iteration", rank=rank)
    # steps as the job numbers them: the validation passes between them count none
    assert [r["step"] for r in its] == [s["step"] for s in t["steps"]]
    assert {r["name"] for r in its} == {"iteration"}
    for r, s in zip(its, t["steps"], strict=True):
        close((r["end_ns"] - r["start_ns"]) / 1e9, (s["end"] - s["start"]) / 1e9,
              f"step {s['step']}")
    # each validation pass, on the job's clock, and its batches
    passes = spans(rows, "evaluation", "pass", rank)
    assert len(passes) == len(t["evals"])
    for p, e in zip(passes, t["evals"], strict=True):
        close((p["end_ns"] - p["start_ns"]) / 1e9, (e["end"] - e["start"]) / 1e9, "pass")
        assert json.loads(p["args"])["batches"] == e["batches"]
    # each save's blocking part, and its bytes where the job counted them
    saves = [r for r in spans(rows, "checkpoint", rank=rank)
             if not json.loads(r["args"]).get("background")]
    assert len(saves) == len(t["saves"])
    for r, s in zip(saves, t["saves"], strict=True):
        close((r["end_ns"] - r["start_ns"]) / 1e9, (s["end"] - s["start"]) / 1e9, s["kind"])
        if "bytes" in s:
            assert r["bytes"] == s["bytes"], (s["kind"], r["bytes"], s["bytes"])
    g = doc["goodput"]
    # the categories and the training steps make the wall time
    assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                           abs=1e-6)
    close(g["training_s"], sum(s["end"] - s["start"] for s in t["steps"]) / 1e9, "training")
    # the steps' time after their optimizer step, out of training: the job's own there
    close(g["after_step_s"], own_after_step(t), "after the steps")
    # start-up: to the first step, less a validation pass before it (evaluation)
    first = t["steps"][0]["start"]
    before = sum(e["end"] - e["start"] for e in t["evals"] if e["end"] <= first)
    close(g["badput_s"]["startup"], (first - t["process_start"] - before) / 1e9, "start-up")
    # its parts make it: torch's import (to its return on the job's clock) among them
    assert sum(g["startup_parts_s"].values()) == pytest.approx(g["badput_s"]["startup"],
                                                               abs=1e-6)
    close(g["startup_parts_s"]["torch_import_s"], (t["torch_imported"] - t["process_start"])
          / 1e9, "torch's import")
    close(g["badput_s"]["evaluation"], sum(e["end"] - e["start"] for e in t["evals"]) / 1e9,
          "evaluation")
    blocking = sum(s["end"] - s["start"] for s in t["saves"]) / 1e9
    close(g["badput_s"]["checkpointing"], blocking, "checkpointing")
    assert abs(g["goodput"] - job_goodput(t)) <= 0.02, (g["goodput"], job_goodput(t))
    assert g["evaluation"]["passes"] == len(t["evals"])


def tol(s: float) -> float:
    return max(0.10 * s, 0.050)


def asked(doc: dict, t: dict, own_s: float, large: float) -> bool | None:
    """Whether the job's own seconds of a category make it a finding (its share of the run
    from `large`): True where they less their tolerance reach it over the recorded wall
    time (its start-up and training held to the job's clocks), False where they and their
    tolerance stay below it over the job's own wall time (process start to main's end),
    None in between."""
    if (own_s - tol(own_s)) / doc["goodput"]["wall_s"] >= large:
        return True
    if (own_s + tol(own_s)) / ((t["end"] - t["process_start"]) / 1e9) < large:
        return False
    return None


def disk_write_of(trace: Path) -> float | None:
    """The disk's probed write bandwidth the trace carries, if a probe came with it."""
    r = ((load(trace).metadata or {}).get("probe") or {}).get("results", {})
    return r.get("disk_write", {}).get("bytes_per_s")


def check_findings(doc: dict, t: dict, disk_write: float | None) -> int:
    """The evaluation, checkpoint and stalls findings where the job's own time makes them
    one, their figures the job's; how many were asked either way."""
    from gputrace.analyzers.extras import goodput_findings as gp
    got = {f["id"]: f["message"] for f in doc["findings"]}
    own = {"evaluation_large": (sum(e["end"] - e["start"] for e in t["evals"]) / 1e9,
                                gp.EVALUATION_LARGE),
           "checkpoint_large": (sum(s["end"] - s["start"] for s in t["saves"]) / 1e9,
                                gp.CHECKPOINT_LARGE),
           "stalls_large": (sum(s["end"] - s["start"] for s in t["stalls"]) / 1e9,
                            gp.STALLS_LARGE)}
    decided = 0
    for fid, (own_s, large) in own.items():
        want = asked(doc, t, own_s, large)
        if want is None:
            continue
        decided += 1
        assert (fid in got) == want, (fid, own_s, doc["goodput"]["wall_s"], got)
    if "evaluation_large" in got:
        assert f"{len(t['evals'])} passes" in got["evaluation_large"]
    if "checkpoint_large" in got:
        m = got["checkpoint_large"]
        assert f"{len(t['saves'])} saves or loads" in m, m
        each = sum(s["bytes"] for s in t["saves"]) / len(t["saves"]) / 1e6
        assert f"{each:.1f} MB each" in m, (m, each)
        # the rate: the job's bytes over its own save time, within the time's tolerance
        rate = float(m.split(" MB each at ")[1].split(" MB/s")[0])
        secs = sum(s["end"] - s["start"] for s in t["saves"]) / 1e9
        own_rate = sum(s["bytes"] for s in t["saves"]) / 1e6
        assert own_rate / (secs + tol(secs)) - 1 <= rate <= own_rate / max(
            secs - tol(secs), 1e-3) + 1, (m, own_rate / secs)
        if disk_write is None:
            assert "not probed" in m, m
        else:
            assert f"against {disk_write / 1e6:.0f} MB/s probed" in m, (m, disk_write)
    if "stalls_large" in got:
        m = got["stalls_large"]
        secs = sum(s["end"] - s["start"] for s in t["stalls"]) / 1e9
        assert abs(float(m.split(" s ")[0]) - secs) <= tol(secs) + 0.005, (m, secs)
    return decided


def test_a_training_run_with_validation_and_checkpoints(tmp_path):
    """Besides the steps, passes and saves on the job's clock: validation every 10 steps of
    16 batches, saves of 128 MB more than the model and a 0.3 s sleep every 10 steps, so
    that evaluation, checkpointing and stalls can each be a finding; the disk probed first
    (`gputrace probe --only disk`), so that a save's rate stands beside its bandwidth."""
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    env = dict(os.environ, GPUTRACE_CACHE_DIR=str(tmp_path / "cache"))
    run_gputrace("probe", "--only", "disk", "--size", "32MiB", "--dir", str(tmp_path),
                 env=env, check=True)
    probe = json.loads(next((tmp_path / "cache").glob("probe-*.json")).read_text())
    disk_write = probe["results"]["disk_write"].get("bytes_per_s")
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, JOB, str(truth),
                     "--steps", "40", "--eval-every", "10", "--eval-batches", "16",
                     "--save-every", "20", "--save-mb", "128", "--stall-every", "10",
                     "--stall-ms", "300", timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    rows = load(out).table.to_pylist()
    a = run_gputrace("analyze", str(out), "--json", check=True)
    doc = json.loads(a.stdout)
    check_rank(rows, doc, t, None)
    assert disk_write_of(out) == disk_write
    # the job's sleeps, and its own work after each step's optimizer step (nothing records)
    close(doc["goodput"]["badput_s"]["stalls"],
          sum(s["end"] - s["start"] for s in t["stalls"]) / 1e9 + own_after_step(t), "stalls")
    # the job's shares here make at least one of the three a finding, or not, either way
    assert check_findings(doc, t, disk_write) >= 1
    assert doc["iterations"]["count"] == 40
    assert not [c for c in doc["checks"]["violated"] if c["invariant"] == "goodput_sum"]
    # the run's rate: every step's samples over the wall time, below the steps' own rate
    run_rate = doc["goodput"]["run_samples_per_s"]
    assert run_rate == pytest.approx(32 * 40 / doc["goodput"]["wall_s"])
    assert run_rate < doc["throughput"]["samples_per_s"]
    text = run_gputrace("analyze", str(out), check=True).stdout
    assert f"Goodput {doc['goodput']['goodput']:.0%}" in text
    assert "over the whole run" in text
    check_report_chart(out, tmp_path / "r.html", doc, t)


def page_specs(page: Path) -> dict:
    """The Vega-Lite specs the page carries (report.html's `const specs = ...;`)."""
    text = page.read_text()
    head = text.index("const specs = ") + len("const specs = ")
    return json.loads(text[head:text.index(";\nwindow.gputraceViews", head)])


def check_report_chart(trace: Path, page: Path, doc: dict, t: dict,
                       kinds: tuple[str, ...] = ("evaluation", "checkpointing", "stalls")
                       ) -> None:
    """The report's whole-run chart: each evaluation pass, save and stall (`kinds`: those
    of over 20 ms) as a band where the job's own clock has it (seconds from the process's
    start), the goodput bar the analysis's shares; drawn in Chromium where it is
    installed."""
    run_gputrace("report", str(trace), "-o", str(page), check=True)
    spec = page_specs(page)["goodput"]
    bands, bar = (c["data"]["values"][0] for c in spec["vconcat"])
    rows = list(zip(bands["what"], bands["start"], bands["end"], strict=True))
    t0 = t["process_start"]
    for what, own in (("evaluation", t["evals"]), ("checkpointing", t["saves"]),
                      ("stalls", t["stalls"])):
        if what not in kinds:
            continue
        got = [(a, b) for w, a, b in rows if w == what and b - a > 0.02]
        assert len(got) == len(own), (what, got, own)
        for (a, b), o in zip(got, own, strict=True):
            # the job's process start is the kernel's, in 10 ms ticks
            assert abs(a - (o["start"] - t0) / 1e9) <= 0.06, (what, a, o)
            close(b - a, (o["end"] - o["start"]) / 1e9, what)
    g = doc["goodput"]
    share = dict(zip(bar["what"], bar["share"], strict=True))
    assert share["training steps"] == pytest.approx(g["goodput"] * 100, abs=0.01)
    assert share["evaluation"] == pytest.approx(g["badput_share"]["evaluation"] * 100,
                                                abs=0.01)
    assert sum(share.values()) == pytest.approx(100, abs=0.05)
    drawn = browser_state(page)
    if drawn is not None:
        assert drawn["items"] == {"concat_0_marks": len(rows),
                                  "concat_1_marks": len(bar["what"])}
        assert drawn["colour"] == bar["what"]


def browser_state(page: Path) -> dict | None:
    """The whole-run chart as Chromium draws it (tests/test_report's checks: no error, no
    fetch, every chart drawn); None where playwright or Chromium is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    from tests.test_report import CHROMIUM, CHROMIUM_ARGS, open_in_browser
    if not os.access(CHROMIUM, os.X_OK):
        return None
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            state, _ = open_in_browser(b, page, page.parent / "shots")
        finally:
            b.close()
    return state["goodput"]


def test_two_ranks_with_distributed_checkpoints(tmp_path):
    """DDP over gloo on 2 ranks: DCP's async_save every 10 steps (its blocking call and its
    background part apart) and save at the end, evaluation on every rank."""
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, "-m",
                     "torch.distributed.run", "--standalone", "--nproc_per_node", "2", JOB,
                     str(truth), "--ddp", "--steps", "30", "--eval-every", "10",
                     "--save-every", "10", "--async-save", timeout=400)
    assert p.returncode == 0, p.stderr
    rows = load(out).table.to_pylist()
    full = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    for rank in (0, 1):
        t = json.loads((tmp_path / f"t.rank{rank}.json").read_text())
        doc = full["ranks"][str(rank)]
        check_rank(rows, doc, t, rank)
        check_findings(doc, t, disk_write_of(out))
        init = spans(rows, "startup", "init_process_group", rank)
        assert len(init) == 1
        close((init[0]["end_ns"] - init[0]["start_ns"]) / 1e9,
              (t["init"][1] - t["init"][0]) / 1e9, "init_process_group")
        assert doc["goodput"]["startup_parts_s"]["init_process_group_s"] == pytest.approx(
            (init[0]["end_ns"] - init[0]["start_ns"]) / 1e9)
        # the async saves' background parts, apart from their blocking calls
        bg = [r for r in spans(rows, "checkpoint", rank=rank)
              if json.loads(r["args"]).get("background")]
        assert len(bg) == sum(s["kind"] == "async_save" for s in t["saves"]) == 2
    job = full["goodput"]["job"]
    assert job["ranks"] == 2
    assert job["wall_s"] == pytest.approx(sum(full["ranks"][r]["goodput"]["wall_s"]
                                              for r in ("0", "1")))


def test_diff_gives_each_category_before_and_after(tmp_path):
    """Two windowed runs (`--steps 5:5`) whose validation passes take 2 and 8 batches:
    diff's evaluation before and after are each run's own, and the change theirs; each
    side's stalls outside its window its own sleep there and its steps' time after their
    optimizer step there, said under the table."""
    docs = {}
    for side, batches in (("before", "2"), ("after", "8")):
        truth, out = tmp_path / f"{side}.json", tmp_path / f"{side}.arrow"
        p = run_gputrace("record", "-q", "-o", str(out), "--steps", "5:5", "--",
                         sys.executable, JOB, str(truth), "--steps", "20", "--eval-every",
                         "10", "--eval-batches", batches, "--stall-every", "10",
                         "--stall-ms", "100", timeout=300)
        assert p.returncode == 0, p.stderr
        docs[side] = json.loads(truth.read_text())
    d = json.loads(run_gputrace("diff", str(tmp_path / "before.arrow"),
                                str(tmp_path / "after.arrow"), "--json", check=True).stdout)
    ev = d["goodput"]["categories"]["evaluation"]
    own = {}
    for side in ("before", "after"):
        t = docs[side]
        own[side] = sum(e["end"] - e["start"] for e in t["evals"]) / 1e9
        close(ev[side], own[side], side)
        assert abs(d["goodput"]["goodput"][side] - job_goodput(t)) <= 0.02
        # the sleep after step 9, between the window's last step and the next, and the
        # steps' own time after their optimizer step outside the window
        (sleep,) = t["stalls"]
        close(d["goodput"]["stalls_outside_window_s"][side],
              (sleep["end"] - sleep["start"]) / 1e9
              + own_after_step(t, set(range(20)) - set(range(5, 10))),
              f"{side}: stalls outside the window")
    assert ev["change"] == pytest.approx(ev["after"] - ev["before"])
    # the change the jobs' own clocks give (8 batches against 2 is longer on a quiet
    # machine; beside a busy neighbour a 2-batch run's passes once took longer)
    close(ev["change"], own["after"] - own["before"], "change")
    text = run_gputrace("diff", str(tmp_path / "before.arrow"), str(tmp_path / "after.arrow"),
                        check=True).stdout
    assert "The whole run: goodput" in text
    out = d["goodput"]["stalls_outside_window_s"]
    assert (f"of the stalls, {out['before'] * 1e3:.0f} ms before and "
            f"{out['after'] * 1e3:.0f} ms after lie outside the recorded window") in text


def test_diff_of_repeated_runs_gives_each_category_its_interval(tmp_path):
    """Two runs a side, interleaved (`record --repeat 2 --interleave`), whose validation
    passes take 2 and 8 batches: each category a side's mean of its runs' own seconds, and
    its change's interval across the runs holds the job's own change."""
    from gputrace.analyzers.compare.diff_runs import paired
    p = run_gputrace("record", "-q", "--repeat", "2", "-o", str(tmp_path / "b.arrow"),
                     "--interleave", str(tmp_path / "a.arrow"),
                     "--", sys.executable, JOB, str(tmp_path / "b.jsonl"), "--steps", "10",
                     "--eval-every", "5", "--eval-batches", "2",
                     "--", sys.executable, JOB, str(tmp_path / "a.jsonl"), "--steps", "10",
                     "--eval-every", "5", "--eval-batches", "8", timeout=600)
    assert p.returncode == 0, p.stderr
    own = {k: [json.loads(ln) for ln in (tmp_path / f"{k}.jsonl").read_text().splitlines()]
           for k in ("b", "a")}
    assert [len(v) for v in own.values()] == [2, 2]
    runs = [str(tmp_path / f"{k}-{i}.arrow") for k in ("b", "a") for i in (1, 2)]
    d = json.loads(run_gputrace("diff", *runs[:2], "--", *runs[2:], "--json",
                                check=True).stdout)
    g = d["goodput"]
    assert g["runs"] == {"before": 2, "after": 2} and d["noise"]["paired"]

    def evals(t: dict) -> float:
        return sum(e["end"] - e["start"] for e in t["evals"]) / 1e9

    ev = g["categories"]["evaluation"]
    for side, k in (("before", "b"), ("after", "a")):
        close(ev[side], float(np.mean([evals(t) for t in own[k]])), side)
        assert abs(g["goodput"][side] - np.mean([job_goodput(t) for t in own[k]])) <= 0.02
    for r in [g["goodput"], g["wall_s"], *g["categories"].values()]:
        assert r["low"] is not None and r["low"] <= r["change"] <= r["high"], r
        assert r["change"] == pytest.approx(r["after"] - r["before"])
    # the job's own change, and its own interval across the same pairs
    xb, xa = ([evals(t) for t in own[k]] for k in ("b", "a"))
    own_change = float(np.mean(xa) - np.mean(xb))
    assert ev["low"] - tol(np.mean(xb)) <= own_change <= ev["high"] + tol(np.mean(xb))
    ci = paired(xb, xa)
    if ci.low > 0.1 * (ci.high - ci.low):       # the job's own clock calls it a change
        assert ev["beyond_noise"], (ev, ci)
    text = run_gputrace("diff", *runs[:2], "--", *runs[2:], check=True).stdout
    assert "means of 2 runs before, 2 after" in text and "95 % interval" in text


def test_lightning_fit_with_validation_and_model_checkpoint(tmp_path):
    """Lightning's sanity check, its validation every 10 steps and ModelCheckpoint's saves
    against its own hooks (tests/jobs/trainers/lightning_whole.py)."""
    pytest.importorskip("lightning")
    job = Path(JOB).parent / "trainers" / "lightning_whole.py"
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, str(job),
                     str(truth), "--steps", "30", "--val-every", "10", timeout=300)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    rows = load(out).table.to_pylist()
    # steps as Lightning counts them (global_step): the sanity check and the validation
    # batches count none
    assert [r["step"] for r in spans(rows, "iteration")] == t["steps"] == list(range(30))
    passes = spans(rows, "evaluation", "pass")
    assert [json.loads(r["args"])["sanity"] for r in passes] == [e["sanity"] for e in t["evals"]]
    for r, e in zip(passes, t["evals"], strict=True):
        close((r["end_ns"] - r["start_ns"]) / 1e9, (e["end"] - e["start"]) / 1e9, "pass")
    saves = spans(rows, "checkpoint")
    assert [r["name"] for r in saves] == ["lightning.save_checkpoint"] * len(t["saves"])
    for r, s in zip(saves, t["saves"], strict=True):
        close((r["end_ns"] - r["start_ns"]) / 1e9, (s["end"] - s["start"]) / 1e9, "save")
        assert r["bytes"] == s["bytes"]
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    g = doc["goodput"]
    assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                           abs=1e-6)
    close(g["badput_s"]["evaluation"],
          sum(r["end_ns"] - r["start_ns"] for r in passes) / 1e9, "evaluation")


def test_hf_trainer_with_steps_evaluation_and_checkpoints(tmp_path):
    """HF Trainer, eval_strategy and save_strategy "steps": each evaluate and each
    checkpoint against its own clock, the checkpoint's bytes its folder's
    (tests/jobs/trainers/hf_whole.py)."""
    pytest.importorskip("transformers")
    job = Path(JOB).parent / "trainers" / "hf_whole.py"
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, str(job),
                     str(truth), "--steps", "30", "--every", "10", timeout=300)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    rows = load(out).table.to_pylist()
    assert [r["step"] for r in spans(rows, "iteration")] == t["steps"] == list(range(30))
    passes = spans(rows, "evaluation", "pass")
    assert len(passes) == len(t["evals"]) == 3
    for r, e in zip(passes, t["evals"], strict=True):
        close((r["end_ns"] - r["start_ns"]) / 1e9, (e["end"] - e["start"]) / 1e9, "evaluate")
        assert json.loads(r["args"])["batches"] == 4
    saves = spans(rows, "checkpoint")
    assert [r["name"] for r in saves] == ["transformers.save_checkpoint"] * len(t["saves"])
    for r, s in zip(saves, t["saves"], strict=True):
        close((r["end_ns"] - r["start_ns"]) / 1e9, (s["end"] - s["start"]) / 1e9, "save")
        assert r["bytes"] == s["bytes"]
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    g = doc["goodput"]
    assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                           abs=1e-6)
    close(g["badput_s"]["checkpointing"],
          sum(s["end"] - s["start"] for s in t["saves"]) / 1e9, "checkpointing")


def test_a_window_of_steps_counts_training_steps_and_keeps_its_passes(tmp_path):
    """`record --steps 15:10` records the job's steps 15..24 in full, and every validation
    pass and save of the run on its clock, inside the window or not; its goodput counts the
    steps outside the window too (their `run` entries): within 2 points of the job's own,
    its passes, saves and sleeps (one inside the window, two outside) the job's, the
    sleeps outside said apart (there a data wait or other work is not told apart)."""
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--steps", "15:10", "--",
                     sys.executable, JOB, str(truth), "--steps", "40", "--save-every", "10",
                     "--stall-every", "10", "--stall-ms", "200", timeout=300)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    rows = load(out).table.to_pylist()
    its = spans(rows, "iteration")
    assert [r["step"] for r in its] == list(range(15, 25))
    passes = spans(rows, "evaluation", "pass")
    assert len(passes) == len(t["evals"]) == 4
    for ps, e in zip(passes, t["evals"], strict=True):
        close((ps["end_ns"] - ps["start_ns"]) / 1e9, (e["end"] - e["start"]) / 1e9, "pass")
    assert len(spans(rows, "checkpoint")) == len(t["saves"]) == 4
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    g = doc["goodput"]
    assert g["iterations"] == 40
    assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                           abs=1e-6)
    close(g["training_s"], sum(s["end"] - s["start"] for s in t["steps"]) / 1e9, "training")
    assert abs(g["goodput"] - job_goodput(t)) <= 0.02, (g["goodput"], job_goodput(t))
    close(g["badput_s"]["startup"], (t["steps"][0]["start"] - t["process_start"]) / 1e9,
          "start-up")
    close(g["badput_s"]["evaluation"], sum(e["end"] - e["start"] for e in t["evals"]) / 1e9,
          "evaluation")
    close(g["badput_s"]["checkpointing"], sum(s["end"] - s["start"] for s in t["saves"])
          / 1e9, "checkpointing")
    close(g["badput_s"]["stalls"], sum(s["end"] - s["start"] for s in t["stalls"]) / 1e9
          + own_after_step(t), "stalls")
    lo, hi = its[0]["start_ns"], its[-1]["end_ns"]
    outside = [s for s in t["stalls"] if s["end"] <= lo or s["start"] >= hi]
    assert len(outside) == 2, (t["stalls"], lo, hi)
    # outside the window: those sleeps, and the steps' time after their optimizer step
    # there (their `run` entries', where other work is not told apart either)
    close(g["stalls_outside_window_s"], sum(s["end"] - s["start"] for s in outside) / 1e9
          + own_after_step(t, set(range(40)) - set(range(15, 25))),
          "stalls outside the window")
    # the page's bands where the job's clock has its passes, saves and sleeps, inside the
    # window or not, and its caption says what the terminal's stalls row says
    check_report_chart(out, tmp_path / "r.html", doc, t, ("evaluation", "stalls"))
    caption = f"{g['stalls_outside_window_s'] * 1e3:.0f} ms of the stalls outside the window"
    assert caption in (tmp_path / "r.html").read_text()
    text = run_gputrace("analyze", str(out), check=True).stdout
    assert f"({g['stalls_outside_window_s'] * 1e3:.0f} ms outside the window" in text


def test_a_window_that_holds_no_training_step(tmp_path):
    """`record --delay 60` of a job that ends within seconds: no step in the window, so no
    per-iteration figure (the trace as one window would be one 'iteration' of the whole
    run, against the steps' own times); the run's goodput from its steps outside the
    window, within 2 points of the job's own, its 12 steps and their time the job's."""
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--delay", "60", "--",
                     sys.executable, JOB, str(truth), "--steps", "12", "--eval-every", "6",
                     "--eval-batches", "2", timeout=300)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    assert not spans(load(out).table.to_pylist(), "iteration")
    a = run_gputrace("analyze", str(out), check=True)
    assert "Traceback" not in a.stderr
    text = a.stdout
    assert "No training iteration in the recorded window: the run's 12 training steps" \
        in text, text
    assert "per iteration." not in text and "Where an iteration's time goes" not in text
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    g = doc["goodput"]
    assert g["iterations"] == 12
    # --json keeps the trace-as-one-window figures, said withheld with why
    assert [c["invariant"] for c in doc["checks"]["violated"]] == ["iterations_in_window"]
    assert "the per-iteration figures" in doc["withheld"]
    assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                           abs=1e-6)
    close(g["training_s"], sum(s["end"] - s["start"] for s in t["steps"]) / 1e9, "training")
    assert abs(g["goodput"] - job_goodput(t)) <= 0.02, (g["goodput"], job_goodput(t))
    close(g["badput_s"]["evaluation"], sum(e["end"] - e["start"] for e in t["evals"]) / 1e9,
          "evaluation")
    assert f"Goodput {g['goodput']:.0%}: training steps took" in text
    assert "12 training steps" in text and "The whole run: 12 iterations" in text
    # the page as the terminal: that line, no per-iteration chart, the goodput bar its own
    page = tmp_path / "r.html"
    run_gputrace("report", str(out), "-o", str(page), check=True)
    specs = page_specs(page)
    assert "breakdown" not in specs and "timeline" not in specs, list(specs)
    assert "No training iteration in the recorded window" in page.read_text()
    bar = specs["goodput"]["vconcat"][1]["data"]["values"][0]
    share = dict(zip(bar["what"], bar["share"], strict=True))
    assert share["training steps"] == pytest.approx(g["goodput"] * 100, abs=0.01)


def test_torch_compile_is_a_part_of_start_up(tmp_path):
    """A `torch.compile`d model (aot_eager: torch._dynamo's and AOTAutograd's compilation
    without a C++ compiler's, which takes minutes on a loaded CPU): its compilation, inside
    the first training step, is start-up's part `compile_s`, within 10 % of the job's own
    (its first step's forward and backward less the median of the others'), out of the
    training time; goodput within 2 points of the job's own less it."""
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, JOB, str(truth),
                     "--steps", "8", "--eval-every", "0", "--compile", "aot_eager",
                     timeout=400)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    rows = load(out).table.to_pylist()
    assert [r["step"] for r in spans(rows, "iteration")] == list(range(8))
    assert spans(rows, "startup", "compile")
    fb = [s["fb"] / 1e9 for s in t["steps"]]
    own = fb[0] - float(np.median(fb[1:]))
    g = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)["goodput"]
    parts = g["startup_parts_s"]
    close(parts["compile_s"], own, "compilation")
    assert sum(parts.values()) == pytest.approx(g["badput_s"]["startup"], abs=1e-6)
    assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                           abs=1e-6)
    # the compilation taken out of the steps: the rest of them is training (the first
    # call's other work, outside torch._dynamo's compilation, stays in it: the job's own
    # figure of the compilation holds that too, within its tolerance above)
    steps = sum(s["end"] - s["start"] for s in t["steps"]) / 1e9
    close(g["training_s"] + parts["compile_s"], steps, "training and the compilation")
    assert abs(g["training_s"] - (steps - own)) <= tol(own), (g["training_s"], steps, own)
    wall = (t["end"] - t["process_start"]) / 1e9
    assert abs(g["goodput"] - (steps - own) / wall) <= 0.02, (g["goodput"], steps, own, wall)
    close(g["badput_s"]["startup"], (t["steps"][0]["start"] - t["process_start"]) / 1e9
          + own, "start-up with the compilation")


def test_a_stall_after_each_step_is_no_training(tmp_path):
    """A job that sleeps 40 ms after every step's logging, before its next batch request,
    with nothing recorded there (`--after-step-ms 40`): the iterations still run from one
    request to the next (t_iter the job's step and its sleep, the sleep in the breakdown's
    time in no phase), but the run's training is the job's steps, the sleeps stalls: the
    time after each step's optimizer step is the job's own, within 10 %; goodput within 2
    points of the job's own, where counting the sleeps as training gives 13-14 % against
    the job's 8 %."""
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, JOB, str(truth),
                     "--steps", "12", "--eval-every", "0", "--after-step-ms", "40",
                     timeout=300)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    its = spans(load(out).table.to_pylist(), "iteration")
    assert [r["step"] for r in its] == [s["step"] for s in t["steps"]]
    # t_iter as before: each iteration the job's step and its sleep (to its next request)
    for r, s, n in zip(its, t["steps"], t["steps"][1:], strict=False):
        close((r["end_ns"] - r["start_ns"]) / 1e9, (n["start"] - s["start"]) / 1e9,
              f"iteration {s['step']}")
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    assert not doc["checks"]["violated"], doc["checks"]["violated"]
    # each analyzed iteration but the last (it ends with its step) holds a sleep there
    n = doc["iterations"]["analyzed"]
    assert doc["breakdown"]["t_other"]["mean"] * n >= 0.040 * (n - 1)
    g = doc["goodput"]
    assert sum(g["badput_s"].values()) + g["training_s"] == pytest.approx(g["wall_s"],
                                                                           abs=1e-6)
    # training: the iterations less their time after the step, and the job's steps
    spanned = sum(r["end_ns"] - r["start_ns"] for r in its) / 1e9
    assert g["training_s"] == pytest.approx(spanned - g["after_step_s"], abs=1e-6)
    close(g["training_s"], sum(s["end"] - s["start"] for s in t["steps"]) / 1e9, "training")
    assert abs(g["goodput"] - job_goodput(t)) <= 0.02, (g["goodput"], job_goodput(t))
    close(g["after_step_s"], own_after_step(t), "after the steps")
    # nothing recorded at work there: all of it stalls, the sleeps between the steps
    assert g["after_step_stalls_s"] == pytest.approx(g["after_step_s"], abs=1e-6)
    between = [s for s in t["stalls"] if s["end"] <= t["steps"][-1]["start"]]
    assert len(between) == 11
    close(g["badput_s"]["stalls"], sum(s["end"] - s["start"] for s in between) / 1e9,
          "stalls")
    text = run_gputrace("analyze", str(out), check=True).stdout
    assert f"{g['after_step_stalls_s'] * 1e3:.0f} ms of it after a step's last phase" \
        in text, text


def test_a_validation_pass_before_the_first_step(tmp_path):
    """A sanity validation before training (`--eval-first`, the optimizer built): a pass on
    the job's clock, its batches no training iteration, the steps the job's 0..19; a window
    (`--steps 5:5`) still the job's steps 5..9, its job sleeping 30 ms after each step
    (`--after-step-ms 30`): the time after the steps' optimizer step no training, inside
    the window and outside it (from the `run` entries), the job's own within 10 %."""
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, JOB, str(truth),
                     "--steps", "20", "--eval-first", timeout=300)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    assert len(t["evals"]) == 3 and t["evals"][0]["end"] <= t["steps"][0]["start"]
    rows = load(out).table.to_pylist()
    doc = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
    check_rank(rows, doc, t, None)
    assert doc["iterations"]["count"] == 20
    w = tmp_path / "w.arrow"
    p = run_gputrace("record", "-q", "-o", str(w), "--steps", "5:5", "--", sys.executable,
                     JOB, str(tmp_path / "w.json"), "--steps", "12", "--eval-first",
                     "--after-step-ms", "30", timeout=300)
    assert p.returncode == 0, p.stderr
    its = spans(load(w).table.to_pylist(), "iteration")
    assert [r["step"] for r in its] == list(range(5, 10))
    # the job's own steps 5..9: each one's middle inside the iteration of its number
    t = json.loads((tmp_path / "w.json").read_text())
    for r, s in zip(its, t["steps"][5:10], strict=True):
        assert r["start_ns"] < (s["start"] + s["end"]) // 2 < r["end_ns"], (r, s)
    g = json.loads(run_gputrace("analyze", str(w), "--json", check=True).stdout)["goodput"]
    close(g["training_s"], sum(s["end"] - s["start"] for s in t["steps"]) / 1e9, "training")
    assert abs(g["goodput"] - job_goodput(t)) <= 0.02, (g["goodput"], job_goodput(t))
    close(g["after_step_s"], own_after_step(t), "after the steps")
    outside = own_after_step(t, set(range(12)) - set(range(5, 10)))
    close(g["stalls_outside_window_s"], outside, "after the steps outside the window")


def test_an_optimizer_built_and_never_stepped_leaves_inference_iterations(tmp_path):
    """The job builds its optimizer, runs its validation pass and no training step
    (`--eval-first --steps 0`): its 4 batches are an inference iteration each, steps 0..3,
    within the job's own pass; no evaluation written for them."""
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, JOB, str(truth),
                     "--steps", "0", "--eval-first", timeout=300)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    (e,) = t["evals"]
    rows = load(out).table.to_pylist()
    its = spans(rows, "iteration")
    assert [(r["name"], r["step"]) for r in its] == [("inference", k) for k in range(4)]
    assert e["start"] <= its[0]["start_ns"] and its[-1]["end_ns"] <= e["end"] + 50_000_000
    assert not spans(rows, "evaluation")


SAVES = Path(JOB).parent / "trainers" / "saves_whole.py"


def test_hf_save_pretrained_outside_a_trainer(tmp_path):
    """`save_pretrained` of a model a plain loop trains, twice into the same folder: each a
    checkpoint on the job's clock, its bytes the files the folder then holds (all
    rewritten)."""
    pytest.importorskip("transformers")
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, str(SAVES),
                     str(truth), "--kind", "hf", "--steps", "20", "--every", "10",
                     timeout=300)
    assert p.returncode == 0, p.stderr
    t = json.loads(truth.read_text())
    saves = spans(load(out).table.to_pylist(), "checkpoint")
    assert [r["name"] for r in saves] == ["transformers.save_pretrained"] * len(t["saves"])
    assert len(saves) == 2
    for r, s in zip(saves, t["saves"], strict=True):
        close((r["end_ns"] - r["start_ns"]) / 1e9, (s["end"] - s["start"]) / 1e9, "save")
        assert r["bytes"] == s["bytes"]


def test_deepspeed_save_checkpoint(tmp_path):
    """DeepSpeed ZeRO stage 1 on 2 ranks, `engine.save_checkpoint` every 10 steps: each
    rank's save on its own clock, and the ranks' bytes together the tag folder's."""
    pytest.importorskip("deepspeed")
    truth, out = tmp_path / "t.json", tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable, "-m",
                     "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     str(SAVES), str(truth), "--kind", "deepspeed", "--steps", "20",
                     "--every", "10", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = load(out).table.to_pylist()
    per_rank = []
    for rank in (0, 1):
        t = json.loads((tmp_path / f"t.rank{rank}.json").read_text())
        saves = spans(rows, "checkpoint", rank=rank)
        assert [r["name"] for r in saves] == ["deepspeed.save_checkpoint"] * 2
        for r, s in zip(saves, t["saves"], strict=True):
            close((r["end_ns"] - r["start_ns"]) / 1e9, (s["end"] - s["start"]) / 1e9, "save")
        per_rank.append((saves, t))
    for k in range(2):
        folder = per_rank[0][1]["saves"][k]["bytes"]
        assert sum(saves[k]["bytes"] for saves, _ in per_rank) == folder
        # each rank wrote some of it: its optimizer's partition at least
        assert all(saves[k]["bytes"] > 0 for saves, _ in per_rank)
