"""A collective's role from evidence: what a comm span says (who issued it, its mesh
dimension, whether it ran inside the model's forward or backward, its bytes) decides the
parallelism it serves; a collective outside the forward and backward, or of a few bytes, is
never tensor, pipeline or expert parallel nor a gradient unit, but `other`, with the reason.

Real jobs: torchtitan's FSDP2 recipe (tests/jobs/fsdp2_titan.py: activation checkpointing,
`fully_shard` per block and root, bf16 mixed precision, AdamW, `clip_grad_norm_`) on FSDP2's
default mesh and, each block `torch.compile`d as torchtitan does, on a mesh named
`dp_shard`, each counting its own collectives and timing its own iterations; transformers' own FSDP2 (`DistributedConfig(fsdp_size=2)`) under its
Trainer (tests/jobs/trainers/hf_fsdp2.py), timing itself. Then hand-made traces for the
rules those jobs cannot show."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gputrace import load
from gputrace.analyzers import analyze
from gputrace.report.json import to_dict
from tests.tracebuilder import two_ranks

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"
PY = sys.executable
WARMUP = 3


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _cli(*args: str, timeout: float = 900) -> str:
    p = subprocess.run([PY, "-m", "gputrace", *args], capture_output=True, text=True,
                       timeout=timeout, env=_env())
    assert p.returncode == 0, f"gputrace {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout


def _record(out: Path, job: Path, *args: str) -> None:
    _cli("record", "-f", "-o", str(out), "--", PY, "-m", "torch.distributed.run",
         "--standalone", "--nproc_per_node", "2", str(job), *args)


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    """mesh ("default", "dp_shard") -> (trace path, each rank's own truth)."""
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("titan")
    done: dict[str, tuple[Path, dict[int, dict]]] = {}

    def get(mesh: str) -> tuple[Path, dict[int, dict]]:
        if mesh not in done:
            out = d / f"{mesh}.arrow"
            # the named mesh's run also compiles each block, as torchtitan does
            _record(out, JOBS / "fsdp2_titan.py", str(d / mesh), "--mesh", mesh,
                    "--iterations", "8", *(["--compile"] if mesh == "dp_shard" else []))
            done[mesh] = (out, {r: json.load(open(d / f"{mesh}.rank{r}.json")) for r in (0, 1)})
        return done[mesh]

    return get


def _own_t_iter(its: list[dict], skip: int) -> float:
    return float(np.mean([(i["end"] - i["start"]) / 1e9 for i in its[skip:]]))


def _told_other(kind: dict, why: str) -> dict:
    """The kind's collectives all serve no parallelism, with a reason that says `why`."""
    assert set(kind["parallelism"]) == {"other"}, kind
    other = kind["parallelism"]["other"]
    assert any(why in w for w in other["why"]), other
    assert not kind["gradient"]
    return other


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["default", "dp_shard"])
def test_fsdp2_with_clipping_is_fsdp_2_on_2_ranks(titan, mesh):
    """torchtitan's FSDP2 recipe with clip_grad_norm_: the gradient norm's all-reduce (a
    DTensor collective between the backward and the step, as many bytes per iteration as
    the job counted) is `other`, outside the forward and backward; the run is FSDP over the
    2 ranks (the degrees multiply to the world size), no tensor-parallel dimension, term or
    what-if; the job's throughput over 2 data-parallel replicas is the job's own samples
    over its own iteration time; FSDP's all-gathers and reduce-scatters as the job counted
    them."""
    path, truth = titan(mesh)
    d = json.loads(_cli("analyze", str(path), "--json"))
    text = _cli("analyze", str(path))
    a = analyze(load(path))
    head = text.splitlines()[0]
    assert "FSDP, 2 ranks:" in head and "TP" not in head, head
    assert d["parallelism"] is None           # no dimension beyond data parallelism
    for ra in a.ranks.values():
        assert ra.degrees == {"fsdp": 2}, ra.degrees
        assert math.prod(ra.degrees.values()) == a.world_size == 2
    samples = 0.0
    for r, ra in d["ranks"].items():
        own = truth[int(r)]
        skip = ra["iterations"]["warmup_skipped"]
        its = own["iterations"][skip:]
        assert not any(f"t_{x}" in ra["breakdown"] for x in ("tp", "pp", "ep", "cp"))
        # the job's own count: one all-reduce of the norm per iteration, in its clip
        clip = [c for c in own["functional"] if c["it"] >= skip and c["phase"] == "clip"]
        assert {c["kind"] for c in clip} == {"all_reduce"} and len(clip) == len(its)
        kinds = ra["collectives"]["kinds"]
        other = _told_other(kinds["all_reduce"], "outside the forward and backward")
        assert other["count"] == pytest.approx(1.0)
        assert other["bytes"] == pytest.approx(clip[0]["bytes"])
        for k in ("all_gather", "reduce_scatter"):
            n = sum(1 for c in own["calls"] if c["it"] >= skip and c["kind"] == k)
            assert kinds[k]["count"] == pytest.approx(n / len(its), abs=0.01), k
            assert set(kinds[k]["parallelism"]) == {"fsdp"}
        assert ra["throughput"]["samples_per_iteration"] == own["samples"]
        t_iter = _own_t_iter(own["iterations"], skip)
        assert ra["breakdown"]["t_iter"]["mean"] == pytest.approx(t_iter, rel=0.05)
        samples += own["samples"] / t_iter
    job = d["throughput"]["job"]
    assert job["replicas"] == 2 and job["ranks"] == 2
    assert job["samples_per_s"] == pytest.approx(samples, rel=0.05)
    # no tensor-parallel what-if, no data-parallel prediction withheld for it
    assert not any("TP" in w["label"] for w in d["sharded"]["what_if"])
    assert "TP degree" not in text and "tensor parallel" not in text
    assert "over 2 data-parallel replicas" in text
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("all_reduce"))
    assert "other: " in row and "outside the forward and backward" in row, row


def _has_distributed_config() -> bool:
    try:
        from transformers.distributed import DistributedConfig  # noqa: F401
    except Exception:  # noqa: BLE001 - no transformers, or one without its own FSDP2
        return False
    return True


@pytest.mark.slow
def test_transformers_fsdp2_under_its_trainer_is_fsdp_2(tmp_path):
    """transformers' own FSDP2 (a dense mesh with `fsdp` beside an expert mesh with
    `efsdp`, the same ranks) under its Trainer, clipping: FSDP's collectives read on the
    dense mesh's `fsdp` dimension, the norm's all-reduce and the Trainer's gather of the
    token count `other` with their reasons, FSDP over 2 replicas and no TP dimension; the
    job's throughput its own samples over its own steps' time."""
    if not _has_distributed_config():
        pytest.skip("this transformers has no DistributedConfig (its own FSDP2)")
    out = tmp_path / "hf.arrow"
    _record(out, JOBS / "trainers" / "hf_fsdp2.py", str(tmp_path / "hf"), "--steps", "10")
    truth = {r: json.load(open(tmp_path / f"hf.rank{r}.json")) for r in (0, 1)}
    d = json.loads(_cli("analyze", str(out), "--json"))
    text = _cli("analyze", str(out))
    head = text.splitlines()[0]
    assert "FSDP, 2 ranks:" in head and "TP" not in head, head
    assert d["parallelism"] is None
    a = analyze(load(out))
    assert a.main.degrees == {"fsdp": 2}
    assert a.main.groups["fsdp"]["mesh_dim"] == "fsdp"
    samples = 0.0
    for r, ra in d["ranks"].items():
        own = truth[int(r)]
        assert own["world"] == 2
        kinds = ra["collectives"]["kinds"]
        _told_other(kinds["all_reduce"], "outside the forward and backward")
        other = kinds["all_gather"]["parallelism"]["other"]     # the token count
        assert any("beside FSDP's units" in w for w in other["why"]), other
        steps = own["steps"][ra["iterations"]["warmup_skipped"]:]
        assert ra["throughput"]["samples_per_iteration"] == pytest.approx(
            np.mean([s["samples"] for s in steps]))
        t_iter = float(np.mean([(s["end"] - s["start"]) / 1e9 for s in steps]))
        assert ra["breakdown"]["t_iter"]["mean"] == pytest.approx(t_iter, rel=0.05)
        samples += np.mean([s["samples"] for s in steps]) / t_iter
    assert d["throughput"]["job"]["replicas"] == 2
    assert d["throughput"]["job"]["samples_per_s"] == pytest.approx(samples, rel=0.05)
    assert not any("TP" in w["label"] for w in d["sharded"]["what_if"])


# -- hand-made traces ---------------------------------------------------------------------
def _group(name: str, dim: str | None) -> dict:
    g: dict = {"size": 2, "ranks": [0, 1], "name": name}
    if dim is not None:
        g["mesh"] = {"dim": dim, "dims": [dim], "shape": [2]}
    return g


DT = {"functional": True, "issuer": "dtensor"}
MB = 1_000_000


def _kinds(path: Path) -> dict:
    return to_dict(analyze(load(path)))


def test_an_activation_dimension_outside_the_forward_and_backward_is_other(tmp_path):
    """An all-reduce on a mesh dimension named `tp` (and a DTensor one on an unnamed mesh)
    between the backward and the step, and one in the step: no activations, so `other`
    with the reason; the run shows no tensor-parallel dimension, term or unit."""
    path = two_ranks(tmp_path / "t.arrow", [
        ("all_reduce", "none", 40.2, 40.6, MB, {"group": _group("1", "tp")}),
        ("all_reduce", "none", 48.2, 48.6, 228, {"group": _group("0", "dim_0"), **DT}),
        ("all_reduce", "update", 41, 42, MB, {"group": _group("1", "tp")})])
    d = _kinds(path)
    other = _told_other(d["collectives"]["kinds"]["all_reduce"], "not activations")
    assert other["count"] == pytest.approx(3)
    assert any("outside the forward and backward" in w for w in other["why"])
    assert any("in the optimizer's step" in w for w in other["why"])
    assert d["parallelism"] is None and d["units"] == []
    assert "t_tp" not in d["breakdown"]
    out = _cli("analyze", str(path))
    assert "TP" not in out.splitlines()[0]
    assert "other: a collective on mesh dimension tp, but in the optimizer's step" in out


def test_a_scalar_is_never_activations(tmp_path):
    """An 8-byte all-reduce inside the forward on the `tp` dimension (a loss, a count): no
    activations, `other`; the 1 MB one beside it is tensor parallel, degree 2, on 2
    ranks."""
    path = two_ranks(tmp_path / "s.arrow", [
        ("all_reduce", "forward", 5, 6, MB, {"group": _group("1", "tp")}),
        ("all_reduce", "forward", 8, 9, 8, {"group": _group("1", "tp")})])
    d = _kinds(path)
    par = d["collectives"]["kinds"]["all_reduce"]["parallelism"]
    assert set(par) == {"tp", "other"}
    assert par["tp"]["count"] == pytest.approx(1) and par["tp"]["bytes"] == pytest.approx(MB)
    assert par["other"]["count"] == pytest.approx(1) and par["other"]["bytes"] == 8
    assert any("8 B, a scalar" in w for w in par["other"]["why"])
    assert d["parallelism"]["degrees"] == {"tp": 2}
    assert d["breakdown"]["t_tp"]["mean"] == pytest.approx(0.001)


def test_a_loss_reduction_on_the_world_adds_no_data_parallel_dimension(tmp_path):
    """Tensor parallelism on both ranks and the job's 4-byte all-reduce of its loss on the
    world group between the backward and the step: the loss is `other` (never a gradient
    unit, no data-parallel degree), so the run is TP 2 on 2 ranks, not DP 2 x TP 2."""
    path = two_ranks(tmp_path / "l.arrow", [
        ("all_reduce", "forward", 5, 7, MB, {"group": _group("1", "tp")}),
        ("all_reduce", "none", 40.2, 40.5, 4, {"group": {"size": 2, "ranks": [0, 1]}})])
    a = analyze(load(path))
    assert a.main.degrees == {"tp": 2}
    assert a.main.dimensions == "TP 2, 2 ranks"
    assert all(u.nbytes != 4 for u in a.main.model.units)


def test_a_dtensor_redistribution_on_fsdps_own_mesh_is_not_tensor_parallel(tmp_path):
    """4 ranks on an unnamed 2 x 2 mesh: FSDP's all-gathers and reduce-scatters on its
    first dimension (group `0`); a DTensor all-reduce of 1 MB inside the forward on that
    same group (FSDP's mesh dimension: data parallel) is `other` with the reason, one on
    the second dimension (group `7`) tensor parallel: FSDP 2 x TP 2."""
    fs = {"fsdp": "fsdp2", "unit": "layers.0"}

    def grp(name: str, i: int) -> dict:
        return {"size": 2, "ranks": [0, 1], "name": name,
                "mesh": {"dim": f"dim_{i}", "dims": ["dim_0", "dim_1"], "shape": [2, 2]}}

    path = two_ranks(tmp_path / "f.arrow", [
        ("all_gather", "forward", 2, 3, MB, {"group": grp("0", 0), **fs, "role": "unshard"}),
        ("all_reduce", "forward", 5, 6, MB, {"group": grp("0", 0), **DT}),
        ("all_reduce", "forward", 8, 9, MB, {"group": grp("7", 1), **DT}),
        ("reduce_scatter", "backward", 30, 31, MB, {"group": grp("0", 0), **fs,
                                                     "role": "reduce_grad"})], world=4)
    d = _kinds(path)
    par = d["collectives"]["kinds"]["all_reduce"]["parallelism"]
    assert set(par) == {"tp", "other"}
    assert par["tp"]["count"] == pytest.approx(1) and par["other"]["count"] == pytest.approx(1)
    assert any("FSDP's own" in w for w in par["other"]["why"]), par
    assert set(d["collectives"]["kinds"]["all_gather"]["parallelism"]) == {"fsdp"}
    assert d["parallelism"]["degrees"] == {"fsdp": 2, "tp": 2}


NAMED = ["fsdp", "efsdp", "dp_shard", "dp_replicate", "hsdp", "replicate"]


@pytest.mark.parametrize("dim", NAMED)
def test_data_parallel_mesh_names_are_data_parallel(tmp_path, dim):
    """The job's own 1 MB all-reduce in the backward on a mesh dimension with a
    data-parallel name (torchtitan's, transformers' and HSDP's): a gradient unit of plain
    data parallelism; a DTensor one between the backward and the step on it: `other`."""
    path = two_ranks(tmp_path / "n.arrow", [
        ("all_reduce", "backward", 30, 32, MB, {"group": _group("1", dim)}),
        ("all_reduce", "none", 48.2, 48.5, 228, {"group": _group("1", dim), **DT})])
    d = _kinds(path)
    par = d["collectives"]["kinds"]["all_reduce"]["parallelism"]
    assert set(par) == {"dp", "other"}
    assert par["dp"]["count"] == pytest.approx(1)
    assert [u["bytes"] for u in d["units"]] == [MB]
    assert d["parallelism"] is None
