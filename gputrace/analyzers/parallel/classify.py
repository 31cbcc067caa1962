"""Which parallelism each collective serves, from what its comm span says: who issued it
(FSDP's units, DDP's buckets, a pipeline schedule, a DTensor redistribution, the job itself),
its process group (the DeviceMesh dimension it runs on, by the dimension's name), its kind,
when it ran (`phase`: inside the model's forward or backward, or outside them) and its bytes.

- `fsdp`: issued by an FSDP unit (args.fsdp): sharded data parallel (the sharded model);
  DeepSpeed's engine at ZeRO stage 0 (`zero0`: whole gradients all-reduced, nothing
  sharded) is `dp`;
- `pp`: a collective a pipeline schedule issued between its stages (args.pp; DeepSpeed's
  pipeline engine also tags its collectives on the pipeline group), or activations on a
  mesh dimension named for pipelining;
- `tp`, `ep`, `cp`: activation traffic on a mesh dimension named for tensor (or sequence),
  expert or context parallelism; a DTensor redistribution on an unnamed dimension of a mesh
  that is not FSDP's own is tensor parallel (its collectives carry activations forward and
  their gradients backward);
- `ep` also: an all-to-all outside FSDP (tokens dispatched to their experts and combined
  back), and an all-to-all of integers inside the forward or backward however few its
  bytes (args.integer: a MoE layer's exchange of its tokens per expert before dispatch);
- `other`, with the reason (`role`'s second value): a barrier (it moves no data); a
  collective that would be activation traffic by its group or issuer but ran outside the
  forward and backward (a gradient norm before the step, a loss or metric reduction, a
  token count, a flag) or moved a few bytes (a scalar: never activations); a DTensor
  redistribution on FSDP's own mesh dimension (FSDP's mesh is data parallel);
- `dp`: DDP's buckets (spans without args.kind: recorded buckets, imported NCCL kernels),
  and a job's own all-reduce of gradients (decided by the data-parallel rule,
  collectives._gradient);
- `""` (undecided here): the data-parallel rule decides between `dp` and `other`.

Activation traffic is told by when it ran only where the record says (`phase`: a recorded
collective's); an imported kernel (no phase) is told by its group and bytes.

Dimension names follow the conventions of torchtitan, Megatron, DeepSpeed and transformers
meshes: tp/tensor/model/mp/sp/seq, pp/pipe, ep/expert/moe, cp/context/ring, dp/data/ddp/
fsdp/efsdp/hsdp/dp_shard/dp_replicate/replicate/shard."""

from __future__ import annotations

import math
import re
from typing import Any

DIMS = ("dp", "fsdp", "tp", "pp", "ep", "cp", "other")
_BY_NAME = [(re.compile(p), d) for p, d in (
    (r"^(pp|pipe|pipeline)(_|$)", "pp"),
    (r"^(ep|expert|experts|moe)(_|$)", "ep"),
    (r"^(cp|context|ring)(_|$)", "cp"),
    (r"^(tp|tensor|model|mp|sp|seq|sequence)(_|$)", "tp"),
    # efsdp: transformers' expert mesh shards the experts' weights over it (FSDP for experts)
    (r"^(dp|data|ddp|fsdp|efsdp|hsdp|replicate|shard|dp_shard|dp_replicate|dp_cp)(_|$)", "dp"),
)]
PARALLEL = ("tp", "pp", "ep", "cp")
# a collective of at most this many bytes is a scalar or a few values (a norm, a loss, a
# count, a flag): never activations (the smallest activation is a token's hidden vector)
SCALAR_BYTES = 64
ACTIVATION_PHASES = ("forward", "backward")
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


def group_name(a: dict[str, Any]) -> str:
    """The process group's name a comm span ran on, "" unknown."""
    g = a.get("group")
    n = g.get("name") if isinstance(g, dict) else None
    return n if isinstance(n, str) else ""


def not_activations(a: dict[str, Any], nbytes: float = math.nan) -> str:
    """Why a collective is no activation traffic, "" when nothing says so: it ran outside
    the model's forward and backward (a recorded collective's `phase`), or moved a few
    bytes (`nbytes`: this rank's input; args.bytes_out where that is unknown or 0)."""
    phase = a.get("phase")
    if isinstance(phase, str) and phase and phase not in ACTIVATION_PHASES:
        where = "in the optimizer's step" if phase == "update" else "outside the forward " \
            "and backward"
        return (f"{where} (a gradient norm, a loss or metric reduction, a count, a flag): "
                "not activations")
    nb = nbytes if isinstance(nbytes, (int, float)) and nbytes > 0 else a.get("bytes_out")
    if isinstance(nb, (int, float)) and not math.isnan(nb) and 0 < nb <= SCALAR_BYTES:
        return f"{nb:.0f} B, a scalar or a few values (a norm, a loss, a count, a flag): " \
            "not activations"
    return ""


def role(kind: str, contract: bool, a: dict[str, Any], nbytes: float = math.nan,
         fsdp_groups: frozenset[str] = frozenset()) -> tuple[str, str]:
    """A comm span's parallelism ("" where the data-parallel rule decides) and, for
    `other`, why. `nbytes`: its input bytes (the span's); `fsdp_groups`: the process groups
    the rank's FSDP units ran their collectives on (FSDP's own mesh dimensions)."""
    if a.get("fsdp") == "zero0":     # DeepSpeed's engine at ZeRO stage 0: nothing sharded
        return "dp", ""
    if a.get("fsdp"):
        return "fsdp", ""
    if kind == "barrier":     # moves no data: serves no dimension (not even under FSDP)
        return "other", "a barrier: it moves no data"
    if isinstance(a.get("pp"), dict):
        return "pp", ""
    # a group named for a dimension: recorded collectives, and imported NCCL kernels whose
    # trace gave their process group (importers.kineto_groups)
    dim = mesh_dim(a)
    named = by_name(dim) if dim else None
    on = f" on mesh dimension {dim}" if dim else ""
    if a.get("issuer") == "dtensor":
        if named is None and group_name(a) in fsdp_groups and not not_activations(a, nbytes):
            return "other", (f"a DTensor redistribution{on}, FSDP's own (its mesh is data "
                             "parallel): not tensor parallel")
        want = named or "tp"
    elif named in PARALLEL:
        want = named
    elif kind == "all_to_all" and contract:
        want = "ep"
    else:
        return ("dp", "") if not contract else ("", "")
    if want == "ep" and a.get("integer") is True and a.get("phase") in ACTIVATION_PHASES:
        return "ep", ""    # a MoE layer's count exchange (tokens per expert) before dispatch
    why = not_activations(a, nbytes)
    if why:
        src = "a DTensor redistribution" if a.get("issuer") == "dtensor" else \
            "an all-to-all" if want == "ep" and named is None else "a collective"
        return "other", f"{src}{on}, but {why}"
    return want, ""


def dimension(kind: str, contract: bool, a: dict[str, Any], nbytes: float = math.nan,
              fsdp_groups: frozenset[str] = frozenset()) -> str:
    """A comm span's parallelism, or "" where the data-parallel rule decides (role's
    first value)."""
    return role(kind, contract, a, nbytes, fsdp_groups)[0]
