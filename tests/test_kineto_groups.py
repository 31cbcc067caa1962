"""Imported Kineto traces: each NCCL kernel's process group (PyTorch's profiler records it on
the kernel, and on its `record_param_comms` op) becomes the comm args a recorded collective
has, `group` {"size", "ranks", "name", "desc"}, so a DeviceMesh dimension's description
(`mesh_tp`) tells the analysis its parallelism. Checked on a real NCCL trace (HTA's
nccl_data: default_pg, which stays data parallel exactly as before), the same trace with
its group described as a mesh dimension, and a real 2-rank tensor-parallel job profiled by
torch.profiler over gloo, whose trace names no group (gloo records none)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest

import gputrace
from gputrace.importers import import_paths
from gputrace.importers.kineto_groups import group_args
from gputrace.importers.kineto_json import Args

ROOT = Path(__file__).resolve().parents[1]
PG = ("Process Group Name", "Process Group Description", "Process Group Ranks", "Group size")


def _comm_args(path: Path) -> list[dict | None]:
    t = import_paths([str(path)]).table
    comm = t.filter(pc.equal(t.column("cat").cast("string"), "comm"))
    return [json.loads(a) if a else None for a in comm.column("args").to_pylist()]


def _events(shared_data: Path) -> dict:
    return json.loads(gzip.open(shared_data / "kineto/nccl_data.json.gz").read())


def _write(doc: dict, path: Path) -> Path:
    path.write_text(json.dumps(doc))
    return path


def _doc(path: Path) -> dict:
    return gputrace.analyze(str(path), progress=False).to_dict()


def test_nccl_kernels_carry_the_process_group_the_trace_gives(shared_data):
    src = shared_data / "kineto/nccl_data.json.gz"
    kernels = [e["args"] for e in _events(shared_data)["traceEvents"]
               if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    assert kernels and all(k["Process Group Description"] == "default_pg" for k in kernels)
    args = _comm_args(src)
    assert len(args) == len(kernels) == 21
    assert all(a == {"group": {"size": 2, "ranks": [0, 1], "name": "0", "desc": "default_pg"}}
               for a in args)


def test_the_default_group_analyzes_as_without_it(shared_data, tmp_path):
    """The group adds its size to `collectives.group_sizes`; nothing else changes."""
    doc = _events(shared_data)
    for e in doc["traceEvents"]:
        for k in PG:
            (e.get("args") or {}).pop(k, None)
    bare = _doc(_write(doc, tmp_path / "rank0.json"))
    full = _doc(shared_data / "kineto/nccl_data.json.gz")
    for d in (bare, full, *bare["ranks"].values(), *full["ranks"].values()):
        d["collectives"].pop("group_sizes")
    assert "parallelism" not in full or full["parallelism"] is None
    assert json.dumps(bare, sort_keys=True) == json.dumps(full, sort_keys=True)
    kinds = full["collectives"]["kinds"]
    assert {d for k in kinds.values() for d in k["parallelism"]} == {"dp"}


def test_a_mesh_dimensions_description_names_its_parallelism(shared_data, tmp_path):
    """The real trace with its group described as DeviceMesh describes a "tp" dimension's."""
    raw = gzip.open(shared_data / "kineto/nccl_data.json.gz").read()
    path = tmp_path / "rank0.json"
    path.write_bytes(raw.replace(b'"default_pg"', b'"mesh_tp"'))
    d = _doc(path)
    assert set(d["collectives"]["kinds"]["all_reduce"]["parallelism"]) == {"tp"}
    assert d["parallelism"]["degrees"] == {"tp": 2}
    tp = d["parallelism"]["tensor_parallel"]
    assert tp["mesh_dim"] == "tp" and tp["degree"] == 2
    # a GPU timeline has no t_tp term to take out and scale: no TP-degree what-if
    assert "t_tp" not in d["breakdown"] and tp["what_if"] == []
    assert d["speedup"]["unavailable"] and d["what_if"] is None


def test_a_kernel_without_group_takes_its_record_param_comms_ops(shared_data, tmp_path):
    doc = _events(shared_data)
    for e in doc["traceEvents"]:
        a = e.get("args") or {}
        if e.get("cat") == "kernel":
            for k in PG:
                a.pop(k, None)
        elif e.get("name") == "record_param_comms" and a.get("Process Group Description"):
            a["Process Group Description"] = "mesh_pp"
    path = _write(doc, tmp_path / "rank0.json")
    args = _comm_args(path)
    assert len(args) == 21
    assert all(a["group"]["desc"] == "mesh_pp" for a in args)
    r = gputrace.analyze(str(path), progress=False)
    d = r.to_dict()
    assert set(d["collectives"]["kinds"]["all_reduce"]["parallelism"]) == {"pp"}
    # no pipeline schedule in the trace: the headline names the dimension's collectives
    assert "PP 2, 2 ranks: PP 5 all-reduces, 2 broadcasts per iteration" in r.headline


@pytest.mark.parametrize(("fields", "group"), [
    ({"pg_name": "3", "pg_desc": "mesh_tp", "pg_ranks": "[0, 2]", "group_size": 2},
     {"size": 2, "ranks": [0, 2], "name": "3", "desc": "mesh_tp"}),
    ({"pg_name": 5, "pg_desc": "undefined", "pg_ranks": "[0, 1, 2, 3]"},
     {"size": 4, "ranks": [0, 1, 2, 3], "name": "5"}),
    ({"pg_name": "0", "pg_ranks": "[0, 1, ...]", "group_size": 128},
     {"size": 128, "name": "0"}),
    ({"group_size": 1, "pg_ranks": "[]"}, None),     # a `wait`: no group
    ({}, None),
])
def test_group_args_from_the_fields(fields, group):
    got = group_args(Args(**fields))
    assert (json.loads(got)["group"] if got else None) == group


@pytest.mark.slow
def test_a_gloo_tensor_parallel_jobs_kineto_trace_names_no_group(tmp_path):
    """torch.profiler over a real 2-rank TP job on gloo: gloo records no
    `record_param_comms` and no process group on any event (only `gloo:all_reduce` on its
    threads), so nothing tells its all-reduces are tensor parallel: they import as comm
    without a group and the analysis names no dimension (docs/parallelism.md says so)."""
    pytest.importorskip("torch")
    out = tmp_path / "prof"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(ROOT / "tests/jobs/tp_kineto.py"),
                        str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    group = json.loads((tmp_path / "prof.group.rank0.json").read_text())
    assert group["ranks"] == [0, 1]
    for r in (0, 1):
        doc = json.loads((out / f"rank{r}.json").read_text())
        pgs = {c["pg_name"]: c for c in doc["distributedInfo"]["pg_config"]}
        assert pgs[group["name"]]["ranks"] == [0, 1]    # the groups exist, listed once
        evs = doc["traceEvents"]
        assert sum(e.get("name") == "gloo:all_reduce" for e in evs) > 0
        assert not any(e.get("name") == "record_param_comms" for e in evs)
        assert not any(k in (e.get("args") or {}) for e in evs for k in PG)
    args = _comm_args(out)
    assert args and all(a is None for a in args)
    d = _doc(out)
    assert d.get("parallelism") is None
    assert "tp" not in d["collectives"]["kinds"]["all_reduce"]["parallelism"]
