"""`flops` of analyze --json: the trace's `flops` rows (one per process that counted an
iteration) read beside the analysis, with each layer's measured times over the analyzed
iterations (analyzers.compare.diff_parts) and the peaks (analyzers.extras.flops)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace.analyzers.extras import flops as fl

_COLUMNS = ("kind", "cat", "name", "start_ns", "end_ns", "rank", "layer", "device", "args")
NONE = ("the trace holds no FLOP count (a trace recorded before gputrace counted FLOPs, "
        "imported from another tool, or of a job that is not PyTorch)")


TENSORFLOW = "TensorFlow jobs are not counted yet"


def _statuses(md: Any) -> list[str]:
    """Every process's `collectors.flops` status in the (merged) metadata."""
    out: list[str] = []
    if isinstance(md, dict):
        st = (md.get("collectors") or {}).get("flops")
        if isinstance(st, dict) and st.get("status"):
            out.append(str(st["status"]))
        for s in md.get("shards") or []:
            out += _statuses(s)
    return out


def _tensorflow(md: Any) -> bool:
    """Whether a process of the (merged) trace ran TensorFlow or Keras."""
    if not isinstance(md, dict):
        return False
    sw = md.get("software") or {}
    return (isinstance(sw, dict) and ("tensorflow" in sw or "keras" in sw)) or \
        any(_tensorflow(s) for s in md.get("shards") or [])


def _table(inputs: Sequence[str]) -> pa.Table | None:
    parts = []
    for p in inputs:
        if not (p.endswith(".arrow") and os.path.isfile(p)):
            from gputrace.analysis.inputs import load_inputs

            return getattr(load_inputs(list(inputs), quiet=True), "table", None)
        try:
            with pa.memory_map(p) as src:
                r = pa.ipc.open_file(src)
                idx = [r.schema.get_field_index(c) for c in _COLUMNS]
                r = pa.ipc.open_file(src, options=pa.ipc.IpcReadOptions(included_fields=idx))
                parts.append(r.read_all())
        except (OSError, pa.ArrowException):
            return None
    return pa.concat_tables(parts, promote_options="permissive") if parts else None


def flops_doc(a: Any, shown: int, inputs: Sequence[str]) -> dict[str, Any]:
    statuses = _statuses(a.metadata)
    if not any(s == "ok" for s in statuses):
        # a training process's reason before a launcher's (torchrun's own process trains
        # nothing: "fewer than 3 training iterations")
        why = next((s.removeprefix("unavailable: ") for s in sorted(
            (s for s in statuses if s != "ok"), key=lambda s: "fewer than" in s)), None)
        if why == "off":
            why = "recorded with --flops off"
        if why is None and _tensorflow(a.metadata):
            why = TENSORFLOW
        return fl.not_counted(why or NONE)
    table = _table(inputs)
    if table is None:
        return fl.not_counted("the trace could not be read for them")
    cat = table["cat"].cast(pa.string())
    rows = table.filter(pc.equal(cat, "flops")).select(
        ["rank", "args", "start_ns", "end_ns"]).to_pylist()
    if not rows:
        return fl.not_counted(NONE)
    ranks = sorted(a.ranks)
    md = a.metadata if isinstance(a.metadata, dict) else {}
    gpus = [g.get("name") for g in md.get("gpus") or [] if isinstance(g, dict)]
    out: dict[str, Any] = {"counted": True, "unavailable": None, "rank": shown, "ranks": {},
                           "layers": []}
    for row in rows:
        r = row["rank"] if row["rank"] in a.ranks else (ranks[0] if len(ranks) == 1 else None)
        if r is None:
            continue
        args = json.loads(row["args"])
        ra = a.ranks[r]
        t_iter = float(ra.breakdown["t_iter"].mean)
        pk = fl.peaks(args, md.get("probe"), gpus)
        out["ranks"][str(r)] = fl.rank_flops(args, t_iter, pk)
        if r == shown:
            peak = pk["vendor"] or pk["probed"]
            out.update({k: args.get(k) for k in ("method", "dtype", "device", "device_name")})
            out["peaks"] = pk
            out["peak_used"] = peak["source"] if peak else None
            left = (row["start_ns"], row["end_ns"]) if ra.flops_left_out is not None else None
            out["layers"] = fl.layers(args, _layer_times(table, ra, left), t_iter,
                                      peak["flops_per_s"] if peak else None,
                                      peak["source"] if peak else None)
            out["finding"] = fl.finding(out["layers"], peak["source"] if peak else None)
    if "peaks" not in out:
        return fl.not_counted(f"rank {shown} counted none")
    return out


def _without_recomputed(table: pa.Table, rank: int) -> pa.Table:
    """The table less the forward spans that ran inside a backward pass: a checkpointed
    layer's forward recomputed there is the backward's work (its FLOPs are the
    recomputation's), not the layer's forward. `rank`: the rank whose backward passes."""
    cat = table["cat"].cast(pa.string())
    outer = table.filter(pc.and_(pc.and_(pc.equal(cat, "backward"), pc.less(table["layer"], 0)),
                                 pc.equal(table["rank"], rank)))
    if not outer.num_rows:
        return table
    from gputrace.analyzers.core import overlap as ov

    lo, hi = ov.union(outer["start_ns"].to_numpy(zero_copy_only=False),
                      outer["end_ns"].to_numpy(zero_copy_only=False))
    start = table["start_ns"].to_numpy(zero_copy_only=False)
    j = np.searchsorted(lo, start, side="right") - 1
    inside = (j >= 0) & (start < hi[np.clip(j, 0, None)])
    fwd = pc.equal(cat, "forward").to_numpy(zero_copy_only=False)
    return table.filter(pa.array(~(fwd & inside)))


def _layer_times(table: pa.Table, ra: Any, left: tuple[int, int] | None = None
                 ) -> dict[int, tuple[float | None, float | None]]:
    """Each layer's forward and backward time per analyzed iteration of rank `ra`; `left`:
    the counted iteration's [start, end), left out as the timings leave it out."""
    from gputrace.analyzers.compare.diff_parts import parts
    from gputrace.analyzers.extras.window import stored_rank

    rank = stored_rank(table, ra.rank)
    m = pc.and_(pc.equal(table["cat"].cast(pa.string()), "iteration"),
                pc.equal(table["name"].cast(pa.string()), "iteration"))
    its = table.filter(pc.and_(m, pc.equal(table["rank"], rank)))
    start = np.sort(its["start_ns"].to_numpy(zero_copy_only=False))[ra.warmup_skipped:]
    if left is not None:
        start = start[(start < left[0]) | (start >= left[1])]
        t = table["start_ns"]
        table = table.filter(pc.or_(pc.less(t, left[0]), pc.greater_equal(t, left[1])))
    if not start.size:
        return {}
    end = int(pc.max(its["end_ns"]).as_py())
    p = parts(_without_recomputed(table, rank), rank, start, end)
    out: dict[int, tuple[float | None, float | None]] = {}
    for ph, i in (("forward", 0), ("backward", 1)):
        for key, v in getattr(p, ph).items():
            ly = int(key.split(" ", 1)[0])
            cur = list(out.get(ly, (None, None)))
            cur[i] = (cur[i] or 0.0) + v["time_s"]
            out[ly] = (cur[0], cur[1])
    return out
