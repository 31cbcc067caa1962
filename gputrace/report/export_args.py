"""What a slice of an exported timeline says: its label and its arguments (a collective's
record-contract args flattened for a viewer's argument panel, with the parallelism it serves;
a pipeline span's stage and microbatch)."""

from __future__ import annotations

import json
from typing import Any

from gputrace.analyzers.parallel import classify

COMM_ARGS = ("kind", "bytes_out", "async", "fsdp", "unit", "role", "prefetch", "issuer",
             "functional")
PIPELINE_ARGS = ("stage", "mb", "schedule", "microbatches", "stages", "num_stages")


def _comm_args(cols: dict[str, Any], i: int) -> dict[str, Any]:
    """A collective's record-contract args, flattened for a viewer's argument panel."""
    a = json_args(cols, i)
    if not a:
        return {}
    out: dict[str, Any] = {k: a[k] for k in COMM_ARGS if k in a and a[k] is not None}
    dim = classify.dimension(str(a.get("kind") or cols["name"][i]), "kind" in a, a)
    if dim:
        out["parallelism"] = dim
    pp = a.get("pp")
    if isinstance(pp, dict):
        out["pp_stage"] = pp["stage"] if isinstance(pp.get("stage"), int) else "several"
    g = a.get("group")
    if isinstance(g, dict):
        for k in ("size", "name", "desc"):
            if k in g:
                out[f"group_{k}"] = g[k]
        if isinstance(g.get("ranks"), list):
            out["group_ranks"] = ",".join(str(r) for r in g["ranks"])
        m = g.get("mesh")
        if isinstance(m, dict):
            if isinstance(m.get("dim"), str):
                out["mesh_dim"] = m["dim"]
            for k in ("dims", "shape"):
                if isinstance(m.get(k), list):
                    out[f"mesh_{k}"] = ",".join(str(x) for x in m[k])
    if isinstance(a.get("layers"), list):
        out["layers"] = ",".join(str(x) for x in a["layers"])
    for k in ("wait", "call"):
        w = a.get(k)
        if isinstance(w, list) and len(w) == 2:
            out[f"{k}_ns"] = int(w[1]) - int(w[0])
    return out


def json_args(cols: dict[str, Any], i: int) -> dict[str, Any]:
    raw = cols["args"][i]
    try:
        a = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return a if isinstance(a, dict) else {}


def _pipeline_args(cols: dict[str, Any], i: int) -> dict[str, Any]:
    """A pipeline span's stage and microbatch (a step's schedule, microbatches, stages)."""
    a = json_args(cols, i)
    return {k: ",".join(str(x) for x in a[k]) if isinstance(a[k], list) else a[k]
            for k in PIPELINE_ARGS if k in a and a[k] is not None}


def label(cols: dict[str, Any], i: int) -> str:
    cat, name = cols["cat"][i], cols["name"][i]
    if cat == "pipeline":    # "forward mb 3", "step (ScheduleGPipe)"
        a = json_args(cols, i)
        if name == "step":
            return f"step ({a['schedule']})" if a.get("schedule") else "step"
        return f"{name} mb {a['mb']}" if isinstance(a.get("mb"), int) else name
    if cat in ("kernel", "memcpy", "memset", "user", "sync", "comm_wait") or name == cat:
        return name
    return f"{cat}: {name}"


def slice_args(cols: dict[str, Any], i: int) -> dict[str, Any]:
    a: dict[str, Any] = {"cat": cols["cat"][i]}
    for k in ("step", "layer"):
        if cols[k][i] >= 0:
            a[k] = int(cols[k][i])
    if cols["phase"][i]:
        a["phase"] = cols["phase"][i]
    if cols["cat"][i] == "comm":
        if cols["bytes"][i] >= 0:
            a["bytes"] = int(cols["bytes"][i])
        a.update(_comm_args(cols, i))
    elif cols["cat"][i] == "pipeline":
        a.update(_pipeline_args(cols, i))
    return a
