"""What-if by replaying the measured gradient timeline: link bandwidth, GPU count and bucket
size (the paper's "merged-layer" future work, Sec. VI).

The replay keeps everything the run measured except gradient communication:

- when each layer's gradient is ready (the end of its backward, mean over the analyzed
  iterations, from the iteration start) and how many bytes it has;
- a comm cost per unit, `alpha + bytes / beta`, fitted to the measured units' service times
  (a unit's time on the link once the one before it has finished), scaled with the ring
  all-reduce factor 2(N-1)/N to other GPU counts; with no measured comm (one process) it is
  the link bandwidth (the probe's all-reduce bus bandwidth or --link-bandwidth), alpha = 0;
- units run one at a time in ready order (one NCCL stream); a unit starts when it is ready
  and the one before it has finished;
- the update waits for the last unit (PyTorch DDP, eq. 10/11; comm after backward, eq. 8,
  is the case where every unit is ready at the end of backward).

The predicted iteration is the measured one plus the change of the exposed tail
max(backward end, last comm end) against the replay of the measured configuration, so the
model's own error cancels; that error is reported beside it (`baseline_error`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gputrace.analyzers.model import ModelResult, ring_factor
from gputrace.analyzers.steps import RankSteps

MIB = 1 << 20
DEFAULT_BUCKETS = (1 * MIB, 5 * MIB, 25 * MIB, 100 * MIB, math.inf)   # inf: one bucket


@dataclass(frozen=True)
class CommCost:
    alpha_s: float
    beta_bytes_per_s: float
    world: int              # the GPU count the fit was made at (1: from a link bandwidth)
    source: str             # "measured" or "link"

    def seconds(self, nbytes: float, gpus: int, bandwidth_x: float = 1.0) -> float:
        if gpus < 2:
            return 0.0
        scale = ring_factor(gpus) / ring_factor(self.world) if self.source == "measured" \
            else ring_factor(gpus)
        return self.alpha_s + nbytes * scale / (self.beta_bytes_per_s * bandwidth_x)


@dataclass(frozen=True)
class Scenario:
    gpus: int                           # 0: the run's own world size (2 for one process)
    bandwidth_x: float = 1.0
    bucket_bytes: float | None = None   # None: the buckets as measured; inf: one bucket

    @property
    def label(self) -> str:
        b = ("measured buckets" if self.bucket_bytes is None else "one bucket"
             if math.isinf(self.bucket_bytes) else f"bucket_cap_mb={self.bucket_bytes / MIB:g}")
        bw = "" if self.bandwidth_x == 1 else f", link x{self.bandwidth_x:g}"
        return f"{self.gpus} GPUs, {b}{bw}"


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    buckets: int
    comm_s: float           # time on the link per iteration (sum of unit times)
    exposed_s: float        # comm past the end of backward
    t_iter: float
    speedup: float          # over one GPU (the same iteration with no comm), weak scaling


@dataclass(frozen=True)
class Replay:
    cost: CommCost
    backward_end_s: float
    measured_t_iter: float
    baseline_t_iter: float          # the replay of the measured configuration, absolute
    baseline_error: float
    layers_known: bool              # per-layer bytes and ready times: bucket what-ifs work
    measured_units: int             # 0: no comm measured; "measured buckets" are DDP's default
    outcomes: list[Outcome]
    assumptions: list[str] = field(default_factory=list)


def service_times(rs: RankSteps, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, seconds on the link) of every measured unit with known bytes: from its start,
    or from the end of the units before it in its iteration when they were still running."""
    u = rs.units
    rows = u.rows(sel)
    if not rows.size:
        return np.zeros(0), np.zeros(0)
    it = u.it[rows]
    t0 = rs.iterations.start[it]
    s, e = u.start[rows] - t0, u.end[rows] - t0          # ns from the iteration start
    width = int(max(e.max(), s.max()) - min(e.min(), s.min(), 0)) + 1
    off = (it - it.min()).astype(np.int64) * width        # one cumulative max per iteration
    before = np.maximum.accumulate(e + off) - off
    first = u.index[rows] == 0
    begin = np.where(first, s, np.maximum(s, np.r_[s[:1], before[:-1]]))
    nb = u.nbytes[rows]
    ok = ~np.isnan(nb) & (e > begin)
    return nb[ok], (e - begin)[ok] / 1e9


def fit_cost(nbytes: np.ndarray, seconds: np.ndarray, world: int) -> CommCost | None:
    """Least squares of seconds = alpha + bytes/beta, alpha >= 0; bytes/seconds if it fails."""
    if nbytes.size == 0 or seconds.sum() <= 0:
        return None
    if np.unique(nbytes).size >= 2:
        slope, alpha = np.polyfit(nbytes, seconds, 1)
        if slope > 0 and alpha >= 0:
            return CommCost(float(alpha), float(1 / slope), world, "measured")
    return CommCost(0.0, float(nbytes.sum() / seconds.sum()), world, "measured")


def layer_profile(rs: RankSteps, sel: np.ndarray) -> tuple[dict[int, float], dict[int, float]]:
    """Per layer: mean backward end from the iteration start (s), and gradient bytes."""
    le = rs.layer_ends
    rows = le.rows(sel)
    layers, inv = np.unique(le.layer[rows], return_inverse=True)
    rel = (le.end[rows] - rs.iterations.start[le.it[rows]]) / 1e9
    mean = np.bincount(inv, weights=rel, minlength=layers.size) / np.bincount(inv)
    ready = dict(zip(layers.tolist(), mean.tolist(), strict=True))
    nbytes = dict(rs.layer_bytes)
    if not nbytes and sel.size:  # older traces: split each unit's bytes over its layers
        u = rs.units
        k = int(sel[-1])
        for row in range(int(u.cuts[k]), int(u.cuts[k + 1])):
            layers = u.layers(row)
            if layers and not math.isnan(u.nbytes[row]):
                for ly in layers:
                    nbytes[ly] = float(u.nbytes[row]) / len(layers)
    return ready, nbytes


def buckets_by_cap(ready: dict[int, float], nbytes: dict[int, float], cap: float
                   ) -> list[tuple[float, float]]:
    """(bytes, ready_s) per bucket, filled like DDP(bucket_cap_mb=cap/MiB): layers from the
    output side, a bucket closes once it holds at least the cap."""
    out: list[tuple[float, float]] = []
    size, when = 0.0, -math.inf
    for ly in sorted((ly for ly in nbytes if ly in ready), reverse=True):
        size += nbytes[ly]
        when = max(when, ready[ly])
        if size >= cap:
            out.append((size, when))
            size, when = 0.0, -math.inf
    if size > 0:
        out.append((size, when))
    return out


def simulate(buckets: Sequence[tuple[float, float]], cost: CommCost, gpus: int,
             bandwidth_x: float = 1.0) -> tuple[float, float]:
    """(comm end from the iteration start, total time on the link); units one at a time."""
    end, busy = -math.inf, 0.0
    for nb, when in sorted(buckets, key=lambda b: b[1]):
        d = cost.seconds(nb, gpus, bandwidth_x)
        end = max(end, when) + d
        busy += d
    return end, busy


def replay(rs: RankSteps, sel: np.ndarray, m: ModelResult, world: int, gpus: Sequence[int],
           link_bytes_per_s: float | None = None,
           extra: Sequence[Scenario] = ()) -> Replay | None:
    """The default what-if grid (GPU counts x bucket sizes, and link x2 / x0.5) plus `extra`;
    None when nothing can be replayed (no comm measured and no link bandwidth known)."""
    if not sel.size:
        return None
    assumptions = []
    nb, sv = service_times(rs, sel)
    cost = fit_cost(nb, sv, world) if world > 1 else None
    if cost is not None:
        assumptions.append(f"comm per unit = {cost.alpha_s * 1e3:.3f} ms + bytes / "
                           f"{cost.beta_bytes_per_s / 1e9:.3f} GB/s, fitted to {nb.size} "
                           f"measured units at {world} ranks, scaled by 2(N-1)/N")
    elif link_bytes_per_s:
        cost = CommCost(0.0, link_bytes_per_s, 1, "link")
        assumptions.append(f"no comm measured: ring all-reduce at "
                           f"{link_bytes_per_s / 1e9:.3f} GB/s bus bandwidth, no latency")
    else:
        return None
    bwd = [(rs.backward_end[k] - rs.iterations.start[k]) / 1e9 for k in sel
           if rs.backward_end[k] >= 0]
    b_end = float(np.mean(bwd)) if bwd else m.measured_t_iter
    ready, nbytes = layer_profile(rs, sel)
    layers_known = bool(ready) and bool(nbytes) and set(nbytes) <= set(ready)
    # Several units that all wait for the end of backward: the framework does not overlap,
    # so no bucket size can; one unit alone cannot tell, and replays like DDP.
    sequential = m.strategy == "sequential" and len(m.units) > 1
    if sequential:
        ready = {ly: b_end for ly in ready}
        assumptions.append("comm after backward: every unit is ready when backward ends")
    measured_units = [(u.nbytes, max(b_end, u.ready_s) if sequential else u.ready_s)
                      for u in m.units
                      if not math.isnan(u.nbytes)]

    if not measured_units:
        assumptions.append("one process: \"measured buckets\" are DDP's default, "
                           "bucket_cap_mb=25")

    def buckets(s: Scenario) -> list[tuple[float, float]]:
        if s.bucket_bytes is None:
            if measured_units:
                return measured_units
            s = Scenario(s.gpus, s.bandwidth_x, 25 * MIB)   # one process: DDP's default cap
        return buckets_by_cap(ready, nbytes, s.bucket_bytes or math.inf)

    def tail(s: Scenario) -> tuple[int, float, float]:
        bs = buckets(s)
        end, busy = simulate(bs, cost, s.gpus, s.bandwidth_x)
        return len(bs), busy, max(b_end, end)

    measured_end = max((u.end_s for u in m.units), default=b_end)
    base_n = world if world > 1 else 1
    _, _, base_tail = tail(Scenario(base_n))
    measured_tail = max(b_end, measured_end)
    baseline = m.measured_t_iter - measured_tail + base_tail
    err = (baseline - m.measured_t_iter) / m.measured_t_iter if m.measured_t_iter else 0.0

    counts = sorted({n for n in (*([world] if world > 1 else []), *gpus) if n > 1})
    scenarios: list[Scenario] = [Scenario(n) for n in counts]
    if layers_known:
        scenarios += [Scenario(n, 1.0, b) for b in DEFAULT_BUCKETS for n in counts]
    else:
        assumptions.append("no per-layer gradient bytes and ready times: bucket sizes are "
                           "not replayed")
    ref = world if world > 1 else (counts[0] if counts else 2)
    scenarios += [Scenario(ref, x) for x in (2.0, 0.5)]
    scenarios += [s for s in (Scenario(x.gpus or ref, x.bandwidth_x, x.bucket_bytes)
                              for x in extra) if s not in scenarios]
    outcomes = []
    # the same iteration with no comm: the measured one without its measured tail past
    # backward (the replay's own error stays out of the one-GPU time, as in eq. 8-11)
    one_gpu = m.measured_t_iter - measured_tail + b_end
    for s in scenarios:
        if s.bucket_bytes is not None and not layers_known:
            continue
        n_b, busy, t = tail(s)
        t_iter = m.measured_t_iter - base_tail + t
        outcomes.append(Outcome(s, n_b, busy, t - b_end, t_iter,
                                s.gpus * one_gpu / t_iter if t_iter > 0 else 0.0))
    return Replay(cost, b_end, m.measured_t_iter, baseline, err, layers_known,
                  len(measured_units), outcomes, assumptions)
