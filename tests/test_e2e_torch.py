"""Real training runs recorded end to end: `gputrace record -- torchrun ... train_cnn.py`
(2 ranks, gloo on the CPU), then the trace's phases and the analysis of each sample case."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gputrace.analyzers.compare.diff_parts import run_wait  # noqa: E402
from gputrace.analyzers.core.frame import build  # noqa: E402
from gputrace.analyzers.core.steps import analyze_rank  # noqa: E402
from gputrace.analyzers.findings.rules import INPUT_MODERATE  # noqa: E402
from gputrace.trace import load  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = str(ROOT / "samples" / "train_cnn.py")
sys.path.insert(0, str(ROOT / "samples"))
from train_cnn import PRESETS, make_model  # noqa: E402

pytestmark = pytest.mark.slow


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", "2", SAMPLE, *args]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def recorded(tmp_path_factory, data_dir):
    """Record each configuration once per test session."""
    out_dir = tmp_path_factory.mktemp("traces")
    cache: dict[str, tuple[Path, str]] = {}

    def get(name: str, cmd: list[str]) -> tuple[Path, str]:
        if name not in cache:
            out = out_dir / f"{name}.arrow"
            p = run_gputrace("record", "-o", str(out), "--", *cmd, timeout=600)
            assert p.returncode == 0, f"{name}:\n{p.stdout}\n{p.stderr[-3000:]}"
            cache[name] = (out, p.stdout + p.stderr)
        return cache[name]

    return get


def rows_of(path):
    return [r for r in load(path).table.to_pylist() if r["kind"] == "span"]


def analysis(path, *extra):
    p = run_gputrace("analyze", str(path), "--json", *extra, check=True)
    return json.loads(p.stdout)


def grad_bytes(preset: str) -> int:
    cfg = PRESETS[preset]
    model = make_model(cfg["width"], cfg["fc_hidden"], cfg["fc_layers"])
    return sum(p.numel() * p.element_size() for p in model.parameters())


def n_layers(preset: str) -> int:
    return 3 + PRESETS[preset]["fc_layers"] + 1


def test_ddp_case1_trace_has_every_phase_on_both_ranks(recorded, data_dir):
    path, log = recorded("case1", torchrun("--preset", "case1", "--iterations", "12",
                                           "--data", data_dir))
    assert "samples/s" in log
    spans = rows_of(path)
    assert {r["rank"] for r in spans if r["rank"] >= 0} == {0, 1}
    L = n_layers("case1")
    for rank in (0, 1):
        mine = [r for r in spans if r["rank"] == rank]
        per_step = defaultdict(Counter)
        for r in mine:
            per_step[r["step"]][r["cat"]] += 1
        steps = sorted(s for s in per_step if s >= 0)
        assert steps[:12] == list(range(12))
        for s in range(12):
            assert per_step[s]["iteration"] == 1 and per_step[s]["update"] == 1, (rank, s)
        # every layer's backward (its forward only with --layer-forward)
        layers = Counter((r["step"], r["layer"]) for r in mine if r["cat"] == "backward" and
                         r["layer"] >= 1)
        for s in range(12):
            assert [ly for ly in range(1, L + 1) if layers[(s, ly)] >= 1] == \
                list(range(1, L + 1)), s
        assert not [r for r in mine if r["cat"] == "forward" and r["layer"] >= 1]
        comm_bytes = Counter()
        for r in mine:
            if r["cat"] == "comm":
                comm_bytes[r["step"]] += r["bytes"]
                assert json.loads(r["args"])["layers"]
        assert all(comm_bytes[s] == grad_bytes("case1") for s in range(12)), comm_bytes
        loop = [r for r in mine if r["cat"] == "iteration"][0]
        waits = [r for r in mine if r["cat"] == "io" and r["name"] != "fetch"]
        assert waits and all((r["pid"], r["tid"]) == (loop["pid"], loop["tid"]) for r in waits)
        fetch = [r for r in mine if r["cat"] == "io" and r["name"] == "fetch"]
        assert fetch and {r["pid"] for r in fetch}.isdisjoint({loop["pid"]})


def test_ddp_case1_buckets_overlap_backward_and_analyze_says_case1(recorded, data_dir):
    path, _ = recorded("case1", torchrun("--preset", "case1", "--iterations", "12",
                                         "--data", data_dir))
    spans = [r for r in rows_of(path) if r["rank"] == 0 and r["step"] >= 3]
    overlapped_steps = set()
    for c in (r for r in spans if r["cat"] == "comm"):
        for b in (r for r in spans if r["cat"] == "backward" and r["layer"] >= 1 and
                  r["step"] == c["step"]):
            if c["start_ns"] < b["end_ns"] and b["start_ns"] < c["end_ns"]:
                overlapped_steps.add(c["step"])
    assert len(overlapped_steps) >= 6  # all-reduce really runs during backward (gloo)
    d = analysis(path)
    assert d["model"]["strategy"] == "wfbp_update_after"
    assert d["model"]["case"] == 1, d["units"]
    assert abs(d["model"]["relative_error"]) < 0.15
    assert set(d["ranks"]) == {"0", "1"}
    assert d["overlap"]["comm"]["hidden_fraction"] > 0.3


def test_ddp_case2_is_exposed(recorded, data_dir):
    path, _ = recorded("case2", torchrun("--preset", "case2", "--iterations", "20",
                                         "--data", data_dir))
    d = analysis(path)
    assert d["model"]["case"] == 2, d["units"]
    assert d["model"]["C"] is not None and d["model"]["C"] >= 2
    assert any(not u["hidden"] for u in d["units"][:-1])
    assert abs(d["model"]["relative_error"]) < 0.15
    assert any(f["id"] == "comm_exposed" for f in d["findings"])
    assert sum(u["bytes"] for u in d["units"]) == grad_bytes("case2")
    # the all-reduces' exposed time by kind is the exposed gradient comm: the same instants
    # (the backward call's wait for the last buckets is not compute; two all-reduces in
    # flight together are exposed once)
    ar = d["collectives"]["kinds"]["all_reduce"]["exposed_s"]
    assert ar == pytest.approx(d["overlap"]["comm"]["exposed_s"], rel=1e-6), (ar, d["overlap"])
    # eq. 11's speedup falls in efficiency as GPUs are added
    assert d["speedup"]["points"] and d["speedup"]["unavailable"] is None
    eff = [p["efficiency"] for p in d["speedup"]["points"]]
    assert eff == sorted(eff, reverse=True)
    # the two ranks shared this host's cores, and the speedup says so
    assert "CPU cores of host" in (d["speedup"]["shared"] or "")
    # the replay of the measured timeline agrees with it at every GPU count, and falls in
    # efficiency too; where the replay of the run itself missed it by over 5 % (a loaded
    # machine: the iterations it replays were not alike) it is withheld, saying so
    if d["what_if"] is None:
        assert "replaying the measured configuration gives" in d["what_if_unavailable"], d
        return
    replayed = {s["gpus"]: s for s in d["what_if"]["scenarios"]
                if s["bucket_rule"] == "measured" and s["bandwidth_x"] == 1}
    # a wait for the other rank is not scaled by either; the replay of the iterations' own
    # timeline and eq. 11's mean terms part as they are extrapolated: beside two CPU hogs
    # the replay came out 1-4 % above eq. 11 at 2 GPUs and 1-10.6 % at 16 (8 runs), 15.2 %
    # at 16 in one CI run. Printed side by side, they agree within 15 % at the measured
    # count and, extrapolated, within the measured error the replay is printed with
    for p in d["speedup"]["points"]:
        s = replayed[p["gpus"]]
        tol = 0.15 if p["gpus"] == d["speedup"]["measured_world_size"] else \
            max(0.15, *(abs(b) for b in s["band"] or ()))
        assert abs(s["speedup"] / p["speedup"] - 1) < tol, (p, s)
    assert all(replayed[p["gpus"]]["speedup"] / p["gpus"] <= replayed[2]["speedup"] / 2 + 1e-9
               for p in d["speedup"]["points"])


def own_iterations(steps_json: Path, trace: Path, n: int) -> tuple[float, float]:
    """The job's own mean iteration (rank 0's clock, seconds) over its last `n`, those
    analyzed; and the time per iteration its processes waited for a CPU meanwhile, a
    rank's share (the kernel's run-queue wait of the job's process tree,
    `proc.run_wait_s`, as the host collector sampled it into the trace): the machine's
    load on the run. 0 where the trace has no such samples."""
    its = json.loads(steps_json.read_text())[-n:]
    mean = sum(i["end"] - i["start"] for i in its) / 1e9 / n
    wait = run_wait(load(str(trace)).table, its[0]["start"], its[-1]["end"], n)
    return mean, wait or 0.0


@pytest.mark.serial
def test_replay_of_one_bucket_predicts_the_run_with_small_buckets(recorded, data_dir, tmp_path):
    """case2 recorded with one 25 MiB bucket, with its own 1 MiB buckets, and with one
    bucket again (A B A); each one-bucket run replayed with 1 MiB buckets predicts the
    1 MiB run at the one-bucket run's load within the what-if's own measured error (its
    band) plus the one-bucket runs' drift at one load, on the jobs' own clocks."""
    def run(name: str, *extra: str) -> tuple[dict, tuple[float, float], Path]:
        steps = tmp_path / f"{name}.steps.json"
        path, _ = recorded(name, torchrun("--preset", "case2", "--iterations", "10",
                                          "--data", data_dir, "--steps-json", str(steps),
                                          *extra))
        d = analysis(path)
        return d, own_iterations(steps, path, d["iterations"]["analyzed"]), path

    (big_a, own_a, path_a), (small, own_small, _), (big_b, own_b, _) = (
        run("case2_25a", "--bucket-cap-mb", "25"), run("case2_1"),
        run("case2_25b", "--bucket-cap-mb", "25"))
    # backward spans carry each layer's gradient bytes
    per_layer = {r["layer"]: r["bytes"] for r in rows_of(path_a)
                 if r["cat"] == "backward" and r["layer"] >= 1 and r["rank"] == 0}
    assert sum(per_layer.values()) == grad_bytes("case2")
    assert len(big_a["units"]) == len(big_b["units"]) == 1
    # Each replay predicts at the speed and load of the run it replays; the 1 MiB run ran
    # between the two, and beside a busy neighbour the machine's load on a run moves from
    # one run to the next: beside two CPU hogs the 1 MiB run's own mean iteration was
    # 0.69-1.40x the one-bucket runs' (126-445 ms iterations for 40-50 ms of the loop's
    # CPU), as its wait for a CPU was 85-196 ms against theirs 66-216 ms; scaling by the
    # forward and update (gloo's comm moved far more than the compute) put one prediction
    # 48 % off. So each prediction is held to the 1 MiB run at the load of the run it
    # replays (its own mean iteration less its wait for a CPU plus that run's wait), within
    # the what-if's band (its error measured on a quiet machine) plus the one-bucket runs'
    # drift: the first against the second as measured, or at the second one's load,
    # whichever is larger (the load explains a run's iteration only in part: beside the
    # hogs the first one's prediction was 29 % over the 1 MiB run at its load where the
    # two one-bucket runs at one load were 7.8 % apart, and 22 % as measured). In CI,
    # quiet, +36 % once and +30 / +25 % once: the band printed for bucket what-ifs now
    # reaches +36 % (whatif_bands: the replay gives small buckets less than they save here).
    t_b, w_b = own_small
    errs = []
    for d, (_, w_a) in ((big_a, own_a), (big_b, own_b)):
        w = d["what_if"]
        if w is None:  # its replay of the run itself over 5 % off (a loaded machine): said
            assert "replaying the measured configuration gives" in d["what_if_unavailable"], d
            continue
        assert w["layers_known"]
        pred = next(s for s in w["scenarios"] if s["gpus"] == 2 and s["bucket_rule"] == "cap"
                    and s["bucket_bytes"] == 1 << 20)
        # the replay makes the small run's buckets, exactly
        assert pred["buckets"] == len(small["units"]) > 1
        # smaller buckets move the large layers' all-reduce beside backward; on the CPU
        # (gloo) that comm takes backward's CPU, so the replay never makes them slower, and
        # it gains only what the link's own time hides
        assert pred["t_iter"] <= w["measured_t_iter"] * (1 + 1e-9)
        assert pred["exposed_s"] < next(s for s in w["scenarios"] if s["gpus"] == 2
                                        and s["bucket_rule"] == "measured")["exposed_s"]
        errs.append(pred["t_iter"] / (t_b - w_b + w_a) - 1)
        lo, hi = pred["band"]
    if not errs:
        return
    (t_a1, w_a1), (t_a2, w_a2) = own_a, own_b
    drift = max(abs(t_a1 / t_a2 - 1), abs((t_a1 - w_a1 + w_a2) / t_a2 - 1))
    err = sum(errs) / len(errs)
    assert lo - drift <= err <= hi + drift, (errs, (lo, hi), drift, own_a, own_small, own_b)


def test_io_bound_sample_gets_an_input_bound_finding(recorded, data_dir, tmp_path):
    """The io preset's loop waits for its loader (the job times each wait itself): t_io is
    that wait, and where it is a finding's share of the iteration the finding is given."""
    own = tmp_path / "waits.json"
    path, _ = recorded("io", [sys.executable, SAMPLE, "--preset", "io", "--iterations", "12",
                              "--samples", "512", "--data", data_dir, "--waits-json",
                              str(own)])
    d = analysis(path)
    found = {f["id"]: f for f in d["findings"]}
    skip = d["iterations"]["warmup_skipped"]
    waits = json.loads(own.read_text())
    trace = load(path)
    rs = analyze_rank(next(iter(build(trace.table, trace.metadata).ranks.values())))
    t_io = rs.terms["t_io"]
    assert t_io.size == len(waits) == 12, (t_io.size, len(waits))
    # iteration by iteration, the median (a preemption of the loop's own steps around
    # next(), inside the job's clock and outside the loader's wait, moves one iteration:
    # 9 iterations' mean 15.3 % under the job's once in a quiet suite): 15 % or 2 ms
    got, want = float(np.median(t_io[skip:])), float(np.median(waits[skip:]))
    assert got == pytest.approx(want, rel=0.15, abs=0.002), (t_io[skip:], waits[skip:])
    wait = sum(waits[skip:]) / len(waits[skip:])
    t_iter = d["breakdown"]["t_iter"]["mean"]
    if wait / t_iter >= 1.2 * INPUT_MODERATE:      # a share the finding is for, with margin
        assert "input_bound" in found, d["findings"]
    # cold cache: the loader's reads reach the disk
    assert d["bandwidth"]["disk_bytes_per_iter"] > 0


def test_users_own_comm_hook_still_runs_and_is_timed(recorded, data_dir):
    path, log = recorded("hook", torchrun("--preset", "case2", "--iterations", "6",
                                          "--comm-hook", "allreduce", "--data", data_dir))
    assert "rank 0: user comm hook ran" in log and "rank 1: user comm hook ran" in log
    comm = [r for r in rows_of(path) if r["cat"] == "comm" and r["rank"] == 0]
    assert len({r["step"] for r in comm}) == 6
    assert all(r["bytes"] > 0 and r["end_ns"] > r["start_ns"] for r in comm)


def test_ddp_gradients_under_record_are_those_of_plain_ddp(tmp_path):
    """gputrace times DDP's buckets with a comm hook of its own in place of DDP's default
    all-reduce: the gradients every backward leaves (the ranks' average) are those of the
    same job run plain, and each bucket is a comm span of its bytes."""
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "tests" / "jobs" / "ddp_grads.py")]
    plain = subprocess.run([*job, str(tmp_path / "plain.json")], capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = tmp_path / "g.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--", *job, str(tmp_path / "rec.json"),
                     timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    want = json.loads((tmp_path / "plain.json").read_text())
    got = json.loads((tmp_path / "rec.json").read_text())
    assert len(got) == len(want) == 4
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), rtol=1e-6, atol=1e-9), \
                (step, i)
    comm = [r for r in rows_of(out) if r["cat"] == "comm" and r["rank"] == 0]
    sizes = sorted(len(v) * 4 for v in want[0])
    for step in range(1, 4):   # after DDP rebuilt its buckets in gradient order
        mine = [r for r in comm if r["step"] == step]
        assert len(mine) >= 2 and sum(r["bytes"] for r in mine) == sum(sizes), (step, mine)
        assert all(json.loads(r["args"])["layers"] for r in mine), mine


def test_optimizer_step_with_closure(recorded, data_dir):
    path, _ = recorded("closure", [sys.executable, SAMPLE, "--closure", "--iterations", "6",
                                   "--workers", "0", "--data", data_dir])
    spans = rows_of(path)
    its = [r for r in spans if r["cat"] == "iteration"]
    assert [r["step"] for r in its] == list(range(6))
    for s in range(6):
        bwd_end = max(r["end_ns"] for r in spans if r["cat"] == "backward" and r["step"] == s)
        (upd,) = [r for r in spans if r["cat"] == "update" and r["step"] == s]
        assert upd["start_ns"] >= bwd_end  # the closure's forward/backward are not "update"


def test_recording_a_model_that_is_not_compiled_never_imports_torch_compile(tmp_path):
    """Each recorded process asks at its model's first forward whether it is
    torch.compile's; importing torch._dynamo to ask took 1 s of CPU (a job of no torch.optim
    step, whose first step imports it anyway: an evaluation, a hand-written update; 1.6 s
    plain, 3.3 s recorded). Such a job ends without it, its layers recorded (the question
    was asked); a compiled one is test_trainers'."""
    job = tmp_path / "job.py"
    job.write_text(
        "import sys, torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))\n"
        "for _ in range(4):\n"
        "    m.zero_grad(); m(torch.randn(4, 8)).sum().backward()\n"
        "    with torch.no_grad():\n"
        "        for q in m.parameters(): q -= 0.1 * q.grad\n"
        "print('torch._dynamo' in sys.modules)\n")
    out = tmp_path / "t.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--layers", "leaves", "--",
                     sys.executable, str(job), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False"], p.stdout
    spans = rows_of(out)
    assert [r["step"] for r in spans if r["cat"] == "iteration"] == [0, 1, 2, 3]
    assert sorted({r["layer"] for r in spans if r["cat"] == "backward" and r["layer"] > 0}) \
        == [1, 2]


def test_instrument_in_a_harness_without_record(tmp_path):
    import subprocess
    import textwrap

    out = tmp_path / "h.arrow"
    code = textwrap.dedent(f"""
        import torch, gputrace, gputrace.torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gputrace.Session({str(out)!r}, sampler=False) as s:
            gputrace.torch.instrument(model, opt, session=s)
            for _ in range(4):
                opt.zero_grad()
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    spans = rows_of(out)
    assert [r["step"] for r in spans if r["cat"] == "iteration"] == [0, 1, 2, 3]
    assert sorted({r["layer"] for r in spans if r["cat"] == "backward" and r["layer"] > 0}) == [1, 2]
    assert load(out).metadata["collectors"]["torch"]["status"] == "ok"


def test_torch_profiler_trace_of_gloo_ddp_has_its_comm_units(tmp_path):
    """A 2-rank gloo DDP job profiled by torch.profiler alone (CPU): gloo's own range around
    each collective becomes a comm unit, as many per iteration as the profile holds."""
    job = str(ROOT / "tests" / "jobs" / "ddp_profiled.py")
    import subprocess
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", job, str(tmp_path)], check=True, timeout=300,
                   capture_output=True)
    per_step = {}
    for r in (0, 1):
        ev = json.loads((tmp_path / f"rank{r}.json").read_text())["traceEvents"]
        steps = sum(1 for e in ev if e.get("name", "").startswith("ProfilerStep#"))
        gloo = sum(1 for e in ev if e.get("name") == "gloo:all_reduce")
        assert steps and gloo and gloo % steps == 0
        per_step[r] = gloo // steps
    d = analysis(tmp_path)
    assert d["world_size"] == 2 and sorted(d["ranks"]) == ["0", "1"]
    for r, ra in d["ranks"].items():
        assert len(ra["units"]) == per_step[int(r)], ra["units"]
        assert ra["breakdown"]["t_comm"]["mean"] > 0
        ov = ra["overlap"]["comm"]
        assert ov["hidden_s"] + ov["exposed_s"] == pytest.approx(ov["total_s"], rel=1e-6)
    assert "no byte counts" in d["what_if_unavailable"]
