"""`flops` of analyze --json: the trace's `flops` rows (one per process that counted an
iteration), with each layer's measured times over the analyzed iterations
(analyzers.extras.layer_times) and the peaks (analyzers.extras.flops), as the analysis kept
them (analyzers.extras.held), or read from the files where it did not (analysis.extras)."""

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


def flops_doc(a: Any, shown: int, inputs: Sequence[str], held: Any = None) -> dict[str, Any]:
    """`flops` for rank `shown`: from the `flops` rows and layer times the analysis kept
    (`held`: analyzers.extras.held.Held), else read from the trace `inputs` (analysis.extras
    says when)."""
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
    if held is not None:
        rows = [(r, f) for r, fs in held.flops.items() for f in fs]
    else:
        table = _table(inputs)
        if table is None:
            return fl.not_counted("the trace could not be read for them")
        rows = _rows(a, table)
    if not rows:
        return fl.not_counted(NONE)
    md = a.metadata if isinstance(a.metadata, dict) else {}
    gpus = [g.get("name") for g in md.get("gpus") or [] if isinstance(g, dict)]
    out: dict[str, Any] = {"counted": True, "unavailable": None, "rank": shown, "ranks": {},
                           "layers": []}
    for r, row in rows:
        args = json.loads(row.args)
        ra = a.ranks[r]
        t_iter = float(ra.breakdown["t_iter"].mean)
        pk = fl.peaks(args, md.get("probe"), gpus)
        out["ranks"][str(r)] = fl.rank_flops(args, t_iter, pk)
        if r == shown:
            peak = pk["vendor"] or pk["probed"]
            out.update({k: args.get(k) for k in ("method", "dtype", "device", "device_name")})
            out["peaks"] = pk
            out["peak_used"] = peak["source"] if peak else None
            out["layers"] = fl.layers(args, row.times, t_iter,
                                      peak["flops_per_s"] if peak else None,
                                      peak["source"] if peak else None)
            out["finding"] = fl.finding(out["layers"], peak["source"] if peak else None)
    if "peaks" not in out:
        return fl.not_counted(f"rank {shown} counted none")
    return out


def _rows(a: Any, table: pa.Table) -> list[tuple[int, Any]]:
    """The `flops` rows of a table read from the files, each with the rank it is taken
    for (a row of a process without a rank: the run's one rank) and, for the rank shown,
    its layers' times (held.FlopsRow)."""
    from gputrace.analyzers.extras.held import FlopsRow

    cat = table["cat"].cast(pa.string())
    ranks = sorted(a.ranks)
    out = []
    for row in table.filter(pc.equal(cat, "flops")).select(
            ["rank", "args", "start_ns", "end_ns"]).to_pylist():
        r = row["rank"] if row["rank"] in a.ranks else (ranks[0] if len(ranks) == 1 else None)
        if r is None:
            continue
        ra = a.ranks[r]
        left = (row["start_ns"], row["end_ns"]) if ra.flops_left_out is not None else None
        out.append((r, FlopsRow(row["args"], row["start_ns"], row["end_ns"],
                                _layer_times(table, ra, left))))
    return out


def _layer_times(table: pa.Table, ra: Any, left: tuple[int, int] | None = None
                 ) -> dict[int, tuple[float | None, float | None]]:
    """Each layer's forward and backward time per analyzed iteration of rank `ra`
    (analyzers.extras.layer_times) from a table of the trace's rows: the rank's own, or
    every row where only one rank is ranked (a job's one process beside its launcher's);
    `left`: the counted iteration's [start, end), left out as the timings leave it out."""
    from gputrace.analyzers.extras.layer_times import layer_times
    from gputrace.analyzers.extras.window import stored_rank

    rank = stored_rank(table, ra.rank)
    ranked = [r for r in pc.unique(table["rank"]).to_pylist() if r is not None and r >= 0]
    rk = table["rank"].to_numpy(zero_copy_only=False)
    mine = rk == rank
    rows = mine if len(ranked) > 1 else np.ones(rk.size, bool)
    cat = np.asarray(table["cat"].cast(pa.string()).to_pylist(), dtype=object)
    name = table["name"].cast(pa.string()).to_pylist()
    start = table["start_ns"].to_numpy(zero_copy_only=False)
    end = pc.coalesce(table["end_ns"], table["start_ns"]).to_numpy(zero_copy_only=False)
    layer = table["layer"].to_numpy(zero_copy_only=False)
    bwd = cat == "backward"
    its = (cat == "iteration") & (np.asarray(name, dtype=object) == "iteration") & mine
    return layer_times(start, end, layer, (cat == "forward") & rows, bwd & rows,
                       lambda idx: [name[i] for i in idx.tolist()], its,
                       bwd & mine & (layer < 0), ra.warmup_skipped, left)
