"""Per-name totals of one rank's analyzed iterations that the analysis does not keep: each
layer's forward and backward, and each GPU kernel (time and count per iteration), and each
name's time in every analyzed iteration (for the change's interval)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace.analyzers.core.layer_names import label, modules_of

Totals = dict[str, dict[str, float]]
Series = dict[str, np.ndarray]      # name -> its time (s) in each analyzed iteration


@dataclass(frozen=True)
class Parts:
    forward: Totals = field(default_factory=dict)
    backward: Totals = field(default_factory=dict)
    kernels: Totals = field(default_factory=dict)
    # "forward", "backward", "kernels" -> each name's per-iteration time (its mean: time_s)
    series: dict[str, Series] = field(default_factory=dict)
    # the traced tree's time runnable and waiting for a CPU behind other processes than its
    # own, per analyzed iteration (None: not recorded): the machine's load on the job
    run_wait_s: float | None = None
    # the rest of that wait: behind the job's own processes (its loader workers, its other
    # ranks), part of what the job does, not noise (None: not recorded or not told apart)
    own_wait_s: float | None = None


def _totals(names: list[str], dur_s: np.ndarray, it: np.ndarray, n: int
            ) -> tuple[Totals, Series]:
    out: Totals = {}
    per: Series = {}
    for name, d, k in zip(names, dur_s.tolist(), it.tolist(), strict=True):
        t = out.setdefault(name, {"time_s": 0.0, "count": 0.0})
        t["time_s"] += d / n
        t["count"] += 1 / n
        per.setdefault(name, np.zeros(n))[k] += d
    return out, per


def parts(table: pa.Table, rank: int, starts_ns: np.ndarray, end_ns: int,
          skip: int | None = None, cpus: object = None) -> Parts:
    """Totals per iteration over the analyzed iterations of `rank` (-1 and the rank itself
    where a trace of one process has no rank), which start at `starts_ns` (in order) and
    end by `end_ns`; a span belongs to the iteration it starts in. `skip`: the index of one
    of them left out (its FLOPs were counted). `cpus`: the host's CPU count, that the
    job's wait for a CPU is told apart by (others_share)."""
    starts_ns = np.asarray(starts_ns, dtype=np.int64)
    n = starts_ns.size
    if n < 1 or table.num_rows == 0:
        return Parts()
    start_ns = int(starts_ns[0])
    wait = run_wait(table, start_ns, end_ns, n)
    share = others_share(table, start_ns, end_ns, cpus)
    own = None if wait is None or share is None else wait * (1 - share)
    if wait is not None and share is not None:
        wait *= share
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
    start = t["start_ns"].to_numpy(zero_copy_only=False)
    dur = (t["end_ns"].to_numpy(zero_copy_only=False) - start) / 1e9
    it = np.clip(np.searchsorted(starts_ns, start, side="right") - 1, 0, n - 1)
    if skip is not None and 0 <= skip < n and n > 1:
        ok = it != skip
        cat, layer, dev, dur = cat[ok], layer[ok], dev[ok], dur[ok]
        name = [name[i] for i in np.flatnonzero(ok)]
        it = it[ok] - (it[ok] > skip)
        n -= 1

    def pick(mask: np.ndarray, label) -> tuple[Totals, Series]:  # type: ignore[no-untyped-def]
        idx = np.flatnonzero(mask)
        return _totals([label(i) for i in idx], dur[idx], it[idx], n)

    modules = modules_of(table, rank)

    def layer_name(i: int) -> str:
        return label(int(layer[i]), name[i], modules.get(int(layer[i])))

    made = {"forward": pick((cat == "forward") & (layer >= 0), layer_name),
            "backward": pick((cat == "backward") & (layer >= 0), layer_name),
            "kernels": pick((cat == "kernel") & (dev >= 0), lambda i: name[i])}
    return Parts(**{k: v[0] for k, v in made.items()},
                 series={k: v[1] for k, v in made.items()}, run_wait_s=wait,
                 own_wait_s=own)


def run_wait(table: pa.Table, start_ns: int, end_ns: int, n: int) -> float | None:
    """The traced tree's run-queue wait (`proc.run_wait_s`, cumulative) from `start_ns` to
    `end_ns`, interpolated between its samples, per iteration of `n` and per rank (the
    tree holds every rank of the host: a rank's share of it; None without at least two
    samples of it, or one host's)."""
    if "name" not in table.column_names or "value" not in table.column_names:
        return None
    t = table.filter(pc.equal(table["name"], "proc.run_wait_s"))
    if t.num_rows < 2 or len(pc.unique(t["host"])) > 1:
        return None
    at = t["start_ns"].to_numpy(zero_copy_only=False)
    v = t["value"].to_numpy(zero_copy_only=False).astype(float)
    order = np.argsort(at, kind="stable")
    at, v = at[order], v[order]
    lo, hi = np.interp([start_ns, end_ns], at, v)
    ranks = [r for r in pc.unique(table["rank"]).to_pylist() if r is not None and r >= 0] \
        if "rank" in table.column_names else []
    return float(max(hi - lo, 0.0)) / n / max(len(ranks), 1)


def _mean_sample(table: pa.Table, name: str, start_ns: int, end_ns: int) -> float | None:
    t = table.filter(pc.equal(table["name"], name))
    at = t["start_ns"].to_numpy(zero_copy_only=False)
    v = t["value"].to_numpy(zero_copy_only=False).astype(float)
    v = v[(at >= start_ns) & (at <= end_ns)]
    return float(np.mean(v)) if v.size else None


def others_share(table: pa.Table, start_ns: int, end_ns: int, cpus: object
                 ) -> float | None:
    """The share of a wait of the traced tree for a CPU from `start_ns` to `end_ns` that
    other processes than the job's caused: the part of the wait that is the machine's load;
    the rest the job's own processes did (more loader workers, more threads: the job's
    demand, not noise). A process waits behind the CPU time of every process but itself: the
    others' (the host's busy CPUs, `cpu.percent` over its `cpus`, less the tree's
    `proc.cpu_percent`) and the job's own beyond one CPU (a process of one busy thread
    takes one; more are its workers or its other ranks); the share is the others' part of
    the two. `cpus`: the host's CPU count (the run's metadata). None where a sample is not
    recorded, the trace holds several hosts, or the CPU count is unknown."""
    if "name" not in table.column_names or "value" not in table.column_names:
        return None
    host = _mean_sample(table, "cpu.percent", start_ns, end_ns)
    tree = _mean_sample(table, "proc.cpu_percent", start_ns, end_ns)
    if not isinstance(cpus, int) or cpus < 1 or host is None or tree is None:
        return None
    if "host" in table.column_names and len(pc.unique(table["host"]).drop_null()) > 1:
        return None
    others = max(host / 100 * cpus - tree / 100, 0.0)
    own = max(tree / 100 - 1.0, 0.0)
    if others + own <= 0:
        return 1.0
    return float(others / (others + own))
