"""FSDP2's settings read from the job, and what-ifs that agree with what was measured: real
2-rank FSDP2 jobs over gloo (tests/jobs/fsdp_train.py) that write the settings they gave
each module and time their own collectives."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_gputrace

JOB = str(Path(__file__).parent / "jobs" / "fsdp_train.py")

# name -> the job's options: backward prefetch set to 1 and to 2 modules, forward prefetch of
# one, the root kept unsharded after forward (the blocks resharded), bf16 parameters with
# float32 reduction; the default (FSDP2's own backward prefetch, every unit resharded)
CONFIGS = {
    "set1": ["--forward-prefetch", "1", "--backward-prefetch", "1", "--keep", "root",
             "--bf16"],
    "set2": ["--backward-prefetch", "2"],
    "base": [],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp_settings")
    done: dict[str, tuple[dict, str, str]] = {}

    def get(name: str) -> tuple[dict, str, str]:
        if name not in done:
            out = d / f"{name}.arrow"
            p = run_gputrace("record", "-f", "-o", str(out), "--", sys.executable, "-m",
                             "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             JOB, str(d / name), "--mode", "fsdp2", "--iterations", "10",
                             "--blocks", "3", *CONFIGS[name], timeout=600)
            assert p.returncode == 0, p.stderr[-3000:]
            js = json.loads(run_gputrace("analyze", str(out), "--json", check=True).stdout)
            text = run_gputrace("analyze", str(out), check=True).stdout
            done[name] = (js, text, str(d / name))
        return done[name]

    return get


def _config(prefix: str, rank: int) -> dict[str, dict]:
    return json.load(open(f"{prefix}.rank{rank}.json"))["config"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["set1", "set2", "base"])
def test_settings_printed_are_the_settings_the_job_gave(runs, name):
    d, text, prefix = runs(name)
    for r, ra in d["ranks"].items():
        cfg = _config(prefix, int(r))
        st = ra["sharded"]["settings"]
        assert st is not None and st["source"] == "job"
        got = {u["unit"]: {k: v for k, v in u.items() if k != "unit"} for u in st["units"]}
        assert got == cfg, (got, cfg)
        fwd = max(len(c["forward_prefetch"]) for c in cfg.values())
        bwd = max(len(c["backward_prefetch"]) if c["backward_prefetch"] else 1
                  for c in cfg.values())
        assert ra["sharded"]["prefetch"] == {"forward": fwd, "backward": bwd}
        assert (st["prefetch_forward"], st["prefetch_backward"]) == (fwd, bwd)
        labels = {w["label"] for w in ra["sharded"]["what_if"]}
        # the run's own setting is no change; FSDP2 cannot turn backward prefetch off
        assert f"forward prefetch {fwd}" not in labels
        assert f"backward prefetch {bwd}" not in labels and "backward prefetch 0" not in labels
        assert {f"forward prefetch {x}" for x in (0, 1, 2) if x != fwd} <= labels
        kept = [u for u, c in cfg.items() if not c["reshard_after_forward"]]
        assert ("reshard_after_forward=False" in labels) == (len(kept) < len(cfg))
        # True only where a unit other than the root (gathered first) was kept
        assert ("reshard_after_forward=True" in labels) == any(u != "" for u in kept)
    line = next(x for x in text.splitlines() if x.startswith("settings (read from the job)"))
    cfg = _config(prefix, 0)
    assert f"forward prefetch {d['sharded']['prefetch']['forward']}" in line
    assert f"backward prefetch {d['sharded']['prefetch']['backward']}" in line
    assert ("set_modules_to_backward_prefetch" in line) == \
        any(c["backward_prefetch"] for c in cfg.values())
    if name == "set1":
        assert "param_dtype bfloat16, reduce_dtype float32" in line
        assert "reshard_after_forward on for 3 of 4 units (off: (root))" in line
    else:
        assert "reshard_after_forward on;" in line and "param_dtype as the parameters" in line
    assert "prefetch depth" not in text      # the guessed depths are not printed beside


def _own_regathers(prefix: str, rank: int, n: int) -> tuple[float, float]:
    """The job's own clock on its backward all-gathers over its last `n` iterations, per
    iteration: the time this rank stood in them, and the part after the later rank entered
    them (the k-th backward all-gather of an iteration is the same call on both ranks; one
    host's clock)."""
    t = [json.load(open(f"{prefix}.rank{r}.json")) for r in (0, 1)]
    its = {i["it"] for i in t[rank]["iterations"][-n:]}
    calls = [[c for c in tr["gathers"] if c["it"] in its and c["phase"] == "backward"]
             for tr in t]
    assert len(calls[0]) == len(calls[1]) > 0
    total = sum(c["end"] - c["t"] for c in calls[rank])
    after = sum(c["end"] - max(c["t"], o["t"])
                for c, o in zip(calls[rank], calls[1 - rank], strict=True))
    return total / 1e9 / n, after / 1e9 / n


@pytest.mark.slow
def test_reshard_false_what_if_removes_the_measured_regathers(runs):
    """Synchronous re-gathers (gloo's: the thread stands in each, prefetched or not): with
    reshard_after_forward=False gone, the prediction moves by the time the job itself stood
    in them once both ranks were in (the wait for the later rank stays: its pace); the
    prefetch what-ifs, moving calls that hold the thread wherever they are issued, by
    little."""
    d, _, prefix = runs("base")
    for r, ra in d["ranks"].items():
        its = ra["iterations"]
        n = its["count"] - its["warmup_skipped"]
        total, after = _own_regathers(prefix, int(r), n)
        w = {x["label"]: x for x in ra["sharded"]["what_if"]}
        measured = ra["breakdown"]["t_iter"]["mean"]
        move = measured - w["reshard_after_forward=False"]["t_iter"]
        assert move == pytest.approx(after, rel=0.15, abs=1e-3), (move, after, total)
        assert move <= total * 1.02
        exposed = sum(u["exposed_s"] for u in ra["sharded"]["units"]
                      if u["role"] == "reshard_gather")
        assert exposed == pytest.approx(total, rel=0.15, abs=5e-4)   # the unit table's
        for label in ("forward prefetch 1", "backward prefetch 2"):
            assert abs(w[label]["t_iter"] - measured) < 0.25 * move, label
        assert abs(ra["sharded"]["baseline_error"]) < 0.05


def test_settings_depths_from_the_units():
    from gputrace.analyzers.parallel.sharded.shardsettings import Settings

    units = [{"unit": "", "reshard_after_forward": False, "forward_prefetch": [],
              "backward_prefetch": None, "param_dtype": None, "reduce_dtype": None},
             {"unit": "blocks.0", "reshard_after_forward": True,
              "forward_prefetch": ["blocks.1"], "backward_prefetch": None,
              "param_dtype": "bfloat16", "reduce_dtype": None},
             {"unit": "blocks.1", "reshard_after_forward": True, "forward_prefetch": [],
              "backward_prefetch": ["blocks.0"], "param_dtype": "bfloat16",
              "reduce_dtype": None}]
    s = Settings(units, 1, 1)
    assert s.keeping == [""] and s.resharding == ["blocks.0", "blocks.1"]
    assert s.one("param_dtype") is None and s.one("reduce_dtype") is None
    t = s.text()
    assert "param_dtype per unit (bfloat16, none set)" in t
    assert "reduce_dtype as the parameters" in t
    assert "backward prefetch 1 (set_modules_to_backward_prefetch)" in t
