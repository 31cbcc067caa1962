"""Which parallelism each collective serves, from what its comm span says: who issued it
(FSDP's units, DDP's buckets, a pipeline schedule, a DTensor redistribution, the job itself),
its process group (the DeviceMesh dimension it runs on, by the dimension's name) and its kind.

- `fsdp`: issued by an FSDP unit (args.fsdp): sharded data parallel (the sharded model);
- `pp`: a send/recv a pipeline schedule issued between its stages (args.pp; DeepSpeed's
  pipeline engine also tags its collectives on the pipeline group), or any collective on a
  mesh dimension named for pipelining;
- `tp`, `ep`, `cp`: on a mesh dimension named for tensor (or sequence), expert or context
  parallelism; a DTensor redistribution on an unnamed dimension is tensor parallel (its
  collectives carry activations forward and their gradients backward);
- `ep` also: an all-to-all outside FSDP (tokens dispatched to their experts and combined
  back);
- `other`: a barrier (it moves no data);
- `dp`: DDP's buckets (spans without args.kind: recorded buckets, imported NCCL kernels),
  and a job's own all-reduce of gradients (decided by the data-parallel rule,
  collectives._gradient);
- `""` (undecided here): the data-parallel rule decides between `dp` and `other`.

Dimension names follow the conventions of torchtitan, Megatron and DeepSpeed meshes:
tp/tensor/model/mp/sp/seq, pp/pipe, ep/expert/moe, cp/context/ring, dp/data/ddp/fsdp/hsdp/
dp_shard/dp_replicate/replicate/shard."""

from __future__ import annotations

import re
from typing import Any

DIMS = ("dp", "fsdp", "tp", "pp", "ep", "cp", "other")
_BY_NAME = [(re.compile(p), d) for p, d in (
    (r"^(pp|pipe|pipeline)(_|$)", "pp"),
    (r"^(ep|expert|experts|moe)(_|$)", "ep"),
    (r"^(cp|context|ring)(_|$)", "cp"),
    (r"^(tp|tensor|model|mp|sp|seq|sequence)(_|$)", "tp"),
    (r"^(dp|data|ddp|fsdp|hsdp|replicate|shard|dp_shard|dp_replicate|dp_cp)(_|$)", "dp"),
)]
NAMES = {"dp": "data parallel", "fsdp": "sharded data parallel (FSDP)",
         "tp": "tensor parallel", "pp": "pipeline parallel", "ep": "expert parallel",
         "cp": "context parallel", "other": "other"}


def by_name(dim: str) -> str | None:
    """The parallelism a mesh dimension's name says, or None."""
    d = dim.lower()
    for pat, what in _BY_NAME:
        if pat.search(d):
            return what
    return None


def mesh_dim(a: dict[str, Any]) -> str:
    """The mesh dimension a comm span's group is, "" when none is known."""
    g = a.get("group")
    m = g.get("mesh") if isinstance(g, dict) else None
    d = m.get("dim") if isinstance(m, dict) else None
    if isinstance(d, str):
        return d
    desc = g.get("desc") if isinstance(g, dict) else None
    return desc[5:] if isinstance(desc, str) and desc.startswith("mesh_") else ""


def dimension(kind: str, contract: bool, a: dict[str, Any]) -> str:
    """A comm span's parallelism, or "" where the data-parallel rule decides."""
    if a.get("fsdp"):
        return "fsdp"
    if kind == "barrier":     # moves no data: serves no dimension (not even under FSDP)
        return "other"
    if isinstance(a.get("pp"), dict):
        return "pp"
    # a group named for a dimension: recorded collectives, and imported NCCL kernels whose
    # trace gave their process group (importers.kineto_groups)
    named = by_name(mesh_dim(a))
    if named in ("tp", "pp", "ep", "cp"):
        return named
    if a.get("issuer") == "dtensor":
        return named or "tp"
    if kind == "all_to_all" and contract:
        return "ep"
    if not contract:
        return "dp"
    return ""
