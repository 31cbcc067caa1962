"""Per-module hooks instead of global ones: a GPT-2-shaped transformer (bench/train_gpt.py, plain
PyTorch) that times its own phases, recorded with `--layers blocks` (the default), `leaves`
and `off`, and with `--layer-forward`; its analysis against the job's own clock, per-block backward under 2-rank gloo
DDP feeding the comm units, and a torch.compile job whose output gputrace leaves alone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gputrace import load  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402
from tests.truth import compare, matched, per_iteration  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "bench" / "train_gpt.py")
BLOCKS = 4
JOB_ARGS = ["--impl", "torch", "--blocks", str(BLOCKS), "--iterations", "14"]
# execution order: wte, wpe, the blocks, ln_f, lm_head (its weight is wte's: no gradient
# of its own)
L_FWD = BLOCKS + 4
L_BWD = BLOCKS + 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One recording per --layers choice (None: the default; "forward": the default with
    --layer-forward)."""
    d = tmp_path_factory.mktemp("layers")
    cache: dict[str | None, tuple[list, Path]] = {}

    def get(layers: str | None) -> tuple[list, Path]:
        if layers not in cache:
            truth, out = d / f"{layers}.json", d / f"{layers}.arrow"
            opt = ["--layer-forward"] if layers == "forward" else \
                ["--layers", layers] if layers else []
            p = run_gputrace("record", "-q", *opt, "-o", str(out), "--", sys.executable,
                             JOB, str(truth), *JOB_ARGS, timeout=600)
            assert p.returncode == 0, p.stderr
            cache[layers] = (json.loads(truth.read_text()), out)
        return cache[layers]

    return get


def spans(path: Path) -> list[dict]:
    return [r for r in load(path).table.to_pylist() if r["kind"] == "span"]


def layers_per_step(rows: list[dict], cat: str) -> dict[int, set[int]]:
    out: dict[int, set[int]] = defaultdict(set)
    for r in rows:
        if r["cat"] == cat and r["layer"] >= 1:
            out[r["step"]].add(r["layer"])
    return out


PHASES = {"t_iter": [], "t_f": ["forward"], "t_b": ["backward"], "t_u": ["update"]}


@pytest.mark.parametrize("layers", [None, "forward", "leaves", "off"])
def test_phases_match_the_jobs_own_clock_at_every_granularity(runs, layers):
    truth, out = runs(layers)
    tr = load(out)
    assert tr.metadata["collectors"]["torch"]["status"] == "ok"
    rs = per_iteration(tr)
    pairs = matched(rs, truth)
    compare(rs, truth, pairs, PHASES, 0.05)


def test_blocks_are_the_default_and_time_each_blocks_backward(runs):
    """By default each block's backward is timed (numbered from the input side), not its
    forward: the analysis needs when gradients are ready, and two forward hooks per block
    would cost the loop about 1 %."""
    truth, out = runs(None)
    rows = spans(out)
    fwd, bwd = layers_per_step(rows, "forward"), layers_per_step(rows, "backward")
    steps = sorted(s for s in bwd if s >= 0)
    assert len(steps) >= 12
    assert not fwd
    for s in steps:
        assert bwd[s] == set(range(1, L_BWD + 1)), s
    names = {r["layer"]: r["name"] for r in rows if r["cat"] == "backward" and r["layer"] >= 1}
    assert [names[i] for i in range(1, L_BWD + 1)] == \
        ["Embedding"] * 2 + ["Block"] * BLOCKS + ["LayerNorm"]
    shards = load(out).metadata["shards"]
    assert [s["torch"]["layer_forward"] for s in shards if "torch" in s] == [False]


def test_layer_forward_times_each_blocks_forward_too(runs):
    _, out = runs("forward")
    rows = spans(out)
    fwd, bwd = layers_per_step(rows, "forward"), layers_per_step(rows, "backward")
    steps = sorted(s for s in bwd if s >= 0)
    assert len(steps) >= 12
    for s in steps:
        assert fwd[s] == set(range(1, L_FWD + 1)), s
        assert bwd[s] == set(range(1, L_BWD + 1)), s
    names = {r["layer"]: r["name"] for r in rows if r["cat"] == "forward" and r["layer"] >= 1}
    assert [names[i] for i in range(3, 3 + BLOCKS)] == ["Block"] * BLOCKS


def test_per_block_backward_tiles_the_jobs_own_backward(runs):
    """The blocks' backward spans run from backward's start to the last gradient, one after
    another: their sum is the job's own backward time (perf_counter around
    loss.backward()) less the autograd call's tail after the last gradient (the
    accumulation of the first block's gradients, the engine's end), which the backward
    phase holds: the phase and the job's time agree too."""
    import numpy as np

    truth, out = runs(None)
    rs = per_iteration(load(out))
    pairs = matched(rs, truth)[3:]
    rows = spans(out)
    per_step: dict[int, float] = defaultdict(float)
    last: dict[int, int] = defaultdict(int)
    for r in rows:
        if r["cat"] == "backward" and r["layer"] >= 1:
            per_step[r["step"]] += (r["end_ns"] - r["start_ns"]) / 1e9
            last[r["step"]] = max(last[r["step"]], r["end_ns"])
    call = {r["step"]: r["end_ns"] for r in rows
            if r["cat"] == "backward" and r["name"] == "backward" and r["layer"] < 0}
    steps = sorted(s for s in per_step if s >= 0)
    ratios, tails = [], []
    for i, k in pairs:
        if k < len(steps):
            s = steps[k]
            tail = (call[s] - last[s]) / 1e9
            assert tail >= 0, (s, tail)
            ratios.append(per_step[s] / (truth[i]["backward"] - tail))
            tails.append(tail)
    assert len(ratios) >= 8
    assert abs(float(np.median(ratios)) - 1) <= 0.05, (ratios, tails)


def test_leaves_time_every_module_with_parameters(runs):
    _, out = runs("leaves")
    rows = spans(out)
    per_block = 6          # ln_1, c_attn, c_proj, ln_2, c_fc, c_proj
    bwd = layers_per_step(rows, "backward")
    steps = [s for s in bwd if s >= 0]
    # wte, wpe, the blocks' modules, ln_f (lm_head, last, shares wte's weight)
    assert steps and all(bwd[s] == set(range(1, per_block * BLOCKS + 3 + 1)) for s in steps)


def test_off_records_phases_without_layers(runs):
    _, out = runs("off")
    rows = spans(out)
    assert not [r for r in rows if r["cat"] in ("forward", "backward") and r["layer"] >= 1]
    cats = {r["cat"] for r in rows}
    assert {"iteration", "forward", "backward", "update"} <= cats
    shards = load(out).metadata["shards"]
    assert [s["torch"]["layers"] for s in shards if "torch" in s] == ["off"]


def test_ddp_comm_units_hold_the_blocks(tmp_path):
    """2-rank gloo DDP of the transformer: every bucket knows the blocks it holds, the buckets
    together hold every block with gradients, and move exactly the model's gradient bytes."""
    out = tmp_path / "ddp.arrow"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", JOB, str(tmp_path / "t.json"), "--impl", "torch", "--blocks", str(BLOCKS),
           "--iterations", "8"]
    p = run_gputrace("record", "-q", "-o", str(out), "--", *cmd, timeout=600)
    assert p.returncode == 0, p.stderr
    sys.path.insert(0, str(ROOT / "bench"))
    from train_gpt import GPT

    model = GPT(1024, 32, 128, BLOCKS, 4)
    grad_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    rows = spans(out)
    for rank in (0, 1):
        comm = [r for r in rows if r["cat"] == "comm" and r["rank"] == rank and r["step"] >= 1]
        by_step: dict[int, list[dict]] = defaultdict(list)
        for r in comm:
            by_step[r["step"]].append(r)
        assert len(by_step) >= 6
        for s, units in by_step.items():
            held = [set(json.loads(r["args"])["layers"]) for r in units]
            assert all(held), (rank, s)
            assert set().union(*held) == set(range(1, L_BWD + 1)), (rank, s)
            assert sum(r["bytes"] for r in units) == grad_bytes
    p = run_gputrace("analyze", str(out), "--json", check=True)
    units = json.loads(p.stdout)["units"]
    assert units and all(u["layers"] for u in units)


def test_torch_compile_job_output_is_its_own(tmp_path):
    """torch.compile with gputrace's hooks in place prints nothing more than without them
    (global module hooks made torch warn into the job's output)."""
    cmd = [sys.executable, JOB, str(tmp_path / "t.json"), "--impl", "torch", "--blocks", "2",
           "--iterations", "3", "--compile", "--compile-backend", "aot_eager", "--print-loss"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "c.arrow"
    rec = run_gputrace("record", "-q", "-o", str(out), "--", *cmd, timeout=600, cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    assert "step 2 loss" in plain.stdout
    assert (rec.stdout, rec.stderr) == (plain.stdout, plain.stderr)
    # and the compiled model's phases and per-block backward are still there
    rows = spans(out)
    assert {"forward", "backward", "update"} <= {r["cat"] for r in rows}
    assert layers_per_step(rows, "backward")[1] == set(range(1, 2 + 3 + 1))


def test_copied_and_pickled_models_run_and_a_loaded_model_is_found(tmp_path):
    """gputrace's module hooks never go into a copy of the model (an EMA deepcopy, a
    torch.save of the whole model): the job runs as without gputrace, and a model made by
    unpickling (no construction seen) is found at its first backward and timed from its
    second iteration on."""
    out = tmp_path / "c.arrow"
    job = [sys.executable, str(ROOT / "tests" / "jobs" / "copied_models.py"), "6"]
    plain = subprocess.run(job, capture_output=True, text=True, timeout=300)
    p = run_gputrace("record", "-q", "-o", str(out), "--", *job, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == plain.stdout and "gputrace" not in p.stderr
    first = int(p.stdout.split()[-1])
    rows = spans(out)
    steps = {r["step"] for r in rows if r["cat"] == "update"}
    assert len(steps) == first + 6
    bwd = layers_per_step(rows, "backward")
    for s in range(first + 1, first + 6):
        assert len(bwd[s]) == 2, (s, dict(bwd))   # the loaded model's two Linear layers
    assert bwd[0] and not bwd[0] & bwd[first + 1]  # new layers, not the first model's


def test_block_backward_ends_at_its_last_gradient_with_one_hook_left(tmp_path):
    """After the first backward a block keeps gputrace's gradient hook on one parameter
    only (the one whose gradient comes last; its other parameters never had one), and each block's backward still ends when the
    job's own hooks see its last gradient: after it (the job's hooks were registered first
    and run first) and before the next block's first. A routed block whose last gradient
    changes gets every hook back: its end is missed in at most one iteration. Order, not a
    duration: a busy machine may stall any hook."""
    truth, out = tmp_path / "t.json", tmp_path / "g.arrow"
    n = 10
    p = run_gputrace("record", "-q", "-o", str(out), "--", sys.executable,
                     str(ROOT / "tests" / "jobs" / "grad_order.py"), str(truth), str(n),
                     timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(truth.read_text())
    first = {(s, b): t for s, b, t in got["first"]}
    last = {(s, b): t for s, b, t in got["last"]}
    # the job's own hook on each parameter, and gputrace's on one per static block
    for b in (0, 1, 3):
        assert sorted(got["hooks"][b]) == [1] * 5 + [2], (b, got["hooks"])
    assert all(h == 2 for h in got["hooks"][2]), got["hooks"][2]   # routed: all again
    # where the job put no hook: one parameter per block ever got a post-accumulate-grad
    # hook (torch keeps it for the tensor's life), and the pre-hooks that found it are gone
    for block in got["bare"]:
        assert sorted(block) == [[False, False]] * 5 + [[True, False]], got["bare"]
    ends = {(r["step"], r["layer"] - 1): r["end_ns"] for r in spans(out)
            if r["cat"] == "backward" and 1 <= r["layer"] <= 4}   # the first model's
    steps = sorted({s for s, _ in ends})
    assert len(steps) == n
    slack = 50_000   # the job's clock (time_ns) against the trace's (perf_counter, anchored)
    off = []
    for b in range(4):   # backward runs the blocks from 3 down to 0
        for s in steps:
            end = ends.get((s, b))
            if end is None or end < last[(s, b)] - slack or \
                    (b > 0 and end > first[(s, b - 1)] + slack):
                off.append((s, b))
    assert all(b == 2 for _, b in off) and len(off) <= 1, off
