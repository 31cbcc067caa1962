"""Per-name totals of one rank's analyzed iterations that the analysis does not keep: each
layer's forward and backward, and each GPU kernel (time and count per iteration)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

Totals = dict[str, dict[str, float]]


@dataclass(frozen=True)
class Parts:
    forward: Totals = field(default_factory=dict)
    backward: Totals = field(default_factory=dict)
    kernels: Totals = field(default_factory=dict)


def _totals(names: list[str], dur_s: np.ndarray, n: int) -> Totals:
    out: Totals = {}
    for name, d in zip(names, dur_s.tolist(), strict=True):
        t = out.setdefault(name, {"time_s": 0.0, "count": 0.0})
        t["time_s"] += d / n
        t["count"] += 1 / n
    return out


def parts(table: pa.Table, rank: int, start_ns: int, end_ns: int, n: int) -> Parts:
    """Totals per iteration over the `n` iterations in [start_ns, end_ns] of `rank` (-1 and
    the rank itself where a trace of one process has no rank)."""
    if n < 1 or table.num_rows == 0:
        return Parts()
    cols = ["cat", "name", "start_ns", "end_ns", "rank", "layer", "device"]
    t = table.select([c for c in cols if c in table.column_names])
    m = pc.and_(pc.greater_equal(t["start_ns"], start_ns), pc.less_equal(t["end_ns"], end_ns))
    ranks = pc.unique(t["rank"]).to_pylist()
    if len([r for r in ranks if r is not None and r >= 0]) > 1:
        m = pc.and_(m, pc.equal(t["rank"], rank))
    t = t.filter(m)
    cat = np.asarray(t["cat"].cast(pa.string()).to_pylist(), dtype=object)
    name = t["name"].cast(pa.string()).to_pylist()
    layer = t["layer"].to_numpy(zero_copy_only=False)
    dev = t["device"].to_numpy(zero_copy_only=False)
    dur = (t["end_ns"].to_numpy(zero_copy_only=False)
           - t["start_ns"].to_numpy(zero_copy_only=False)) / 1e9

    def pick(mask: np.ndarray, label) -> Totals:  # type: ignore[no-untyped-def]
        idx = np.flatnonzero(mask)
        return _totals([label(i) for i in idx], dur[idx], n)

    def layer_name(i: int) -> str:
        return f"{int(layer[i])} {name[i]}"

    return Parts(forward=pick((cat == "forward") & (layer >= 0), layer_name),
                 backward=pick((cat == "backward") & (layer >= 0), layer_name),
                 kernels=pick((cat == "kernel") & (dev >= 0), lambda i: name[i]))
