"""The replay's two pieces of arithmetic: the cost of one comm unit (a fixed latency plus a
time per byte, the host's CPU or the link, scaled by the ring all-reduce factor 2(N-1)/N) fitted
to the measured units, and the run of units one at a time in ready order beside a backward they
may slow (comm on the CPU). `replay` feeds them the run's measured timeline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gputrace.analyzers.core.model import ring_factor

CPU_SHARE = 0.5                  # the CPU a unit gets while compute runs beside it


@dataclass(frozen=True)
class CommCost:
    alpha_s: float
    beta_bytes_per_s: float     # bytes per second of a unit running alone, at `world`
    world: int                  # the GPU count the fit was made at (1: from a link bandwidth)
    source: str                 # "measured" or "link"
    cpu_s_per_byte: float = 0.0          # CPU each byte costs the host (0: not on the CPU)
    wire_bytes_per_s: float | None = None   # the link's bus bandwidth, when known

    def _scale(self, gpus: int) -> float:
        return ring_factor(gpus) / ring_factor(self.world) if self.source == "measured" \
            else ring_factor(gpus)

    def per_byte(self, gpus: int, bandwidth_x: float = 1.0, overlapped: bool = False
                 ) -> tuple[float, float]:
        """(seconds per byte, CPU seconds per byte) of a unit at `gpus` ranks with the link
        `bandwidth_x` times as fast, running alone or beside compute."""
        if gpus < 2:
            return 0.0, 0.0
        k = self._scale(gpus)
        cpu = self.cpu_s_per_byte * k
        if self.wire_bytes_per_s:
            wire = k / (self.wire_bytes_per_s * bandwidth_x)
        elif cpu:                   # no link known: the host's rate stands for it
            wire = cpu / bandwidth_x
        else:
            wire = k / (self.beta_bytes_per_s * bandwidth_x)
        return max(cpu / CPU_SHARE if overlapped else cpu, wire), cpu

    def seconds(self, nbytes: float, gpus: int, bandwidth_x: float = 1.0) -> float:
        """A unit running alone."""
        if gpus < 2:
            return 0.0
        return self.alpha_s + nbytes * self.per_byte(gpus, bandwidth_x)[0]


def fit_cost(nbytes: np.ndarray, seconds: np.ndarray, world: int) -> CommCost | None:
    """Least squares of seconds = alpha + bytes/beta, alpha >= 0; bytes/seconds if it fails."""
    if nbytes.size == 0 or seconds.sum() <= 0:
        return None
    if np.unique(nbytes).size >= 2:
        slope, alpha = np.polyfit(nbytes, seconds, 1)
        if slope > 0 and alpha >= 0:
            return CommCost(float(alpha), float(1 / slope), world, "measured")
    return CommCost(0.0, float(nbytes.sum() / seconds.sum()), world, "measured")


def fit_host_cost(nbytes: float, beside_s: float, alone_s: float, world: int,
                  link_bytes_per_s: float | None,
                  host_bytes_per_s: float | None = None) -> CommCost | None:
    """Comm on the CPU (gloo): several units are in flight at once (one gloo queue, several
    threads), so a unit's own span is not its cost; the cost per byte c is what makes the
    bytes of the analyzed iterations fit their comm's busy time, `beside_s` of it beside
    backward (a unit moves at most CPU_SHARE / c bytes per second then) and `alone_s` after
    it (1 / c), each no faster than the link's bus bandwidth when it is known. c is at least
    what the host's own gloo all-reduce costs (`host_bytes_per_s`, when known): a run held
    back by its link does not show it. A unit's fixed cost cannot be told from its bytes in
    one run: it is taken as 0."""
    if nbytes <= 0 or beside_s + alone_s <= 0:
        return None
    wire = ring_factor(world) / link_bytes_per_s if link_bytes_per_s else 0.0

    def moved(c: float) -> float:
        fast_ov = 1 / max(c / CPU_SHARE, wire) if max(c, wire) > 0 else math.inf
        fast = 1 / max(c, wire) if max(c, wire) > 0 else math.inf
        return beside_s * fast_ov + alone_s * fast

    if wire and moved(0.0) <= nbytes * 1.25:
        c = 0.0          # the link explains it (within a quarter): held back by the link
    else:
        lo, hi = 0.0, (beside_s / CPU_SHARE + alone_s) / nbytes * 4 + 1e-15
        for _ in range(100):                 # moved() falls as c grows: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if moved(mid) > nbytes else (lo, mid)
        c = (lo + hi) / 2
    if host_bytes_per_s:
        c = max(c, ring_factor(world) / host_bytes_per_s)
    alone = max(c, wire)
    return CommCost(0.0, 1 / alone if alone > 0 else math.inf, world, "measured",
                    cpu_s_per_byte=c, wire_bytes_per_s=link_bytes_per_s)


def buckets_by_cap(ready: dict[int, float], nbytes: dict[int, float], cap: float,
                   first_cap: float | None = None) -> list[tuple[float, float]]:
    """(bytes, ready_s) per bucket, filled like DDP(bucket_cap_mb=cap/MiB): layers from the
    output side (the order their gradients come), a bucket closes once it holds at least
    its cap; the first bucket's cap is `first_cap` when given (DDP's 1 MiB when
    bucket_cap_mb is left at its default)."""
    out: list[tuple[float, float]] = []
    size, when = 0.0, -math.inf
    limit = cap if first_cap is None else first_cap
    for ly in sorted((ly for ly in nbytes if ly in ready), key=lambda ly: (ready[ly], -ly)):
        size += nbytes[ly]
        when = max(when, ready[ly])
        if size >= limit:
            out.append((size, when))
            size, when = 0.0, -math.inf
            limit = cap
    if size > 0:
        out.append((size, when))
    return out


@dataclass(frozen=True)
class UnitRun:
    comm_end: float         # when the last unit ends (s from the iteration start)
    busy: float             # time on the link
    backward_end: float     # when backward ends, with what comm took from it


def run_units(buckets: Sequence[tuple[float, ...]], cost: CommCost, gpus: int,
              bandwidth_x: float = 1.0, backward: tuple[float, float] | None = None) -> UnitRun:
    """Units one at a time in ready order: (bytes, ready) each, or (bytes, ready, delay)
    where the unit stays off the link `delay` seconds once it could start (its launch, as
    measured). With `backward` = (start, end) of backward as it would run with no comm
    beside it, the ready times are on that clock: while a unit moves bytes beside backward,
    backward loses the CPU they cost (comm on the CPU) and so ends, and makes the later
    gradients ready, later. Without it, comm alone: ready times are real times and nothing
    slows down."""
    alpha = cost.alpha_s if gpus >= 2 else 0.0
    p_ov, cpu = cost.per_byte(gpus, bandwidth_x, overlapped=True)
    p_alone, _ = cost.per_byte(gpus, bandwidth_x)
    order = sorted(buckets, key=lambda b: b[1])
    if backward is None:
        busy, t = 0.0, -math.inf
        for nb, when, *delay in order:
            d = alpha + nb * p_alone
            t = max(t, when) + (delay[0] if delay else 0.0) + d
            busy += d
        end = t if order else -math.inf
        return UnitRun(end, busy, -math.inf)
    b0, b1 = backward
    slow = 1.0 - (cpu / p_ov if p_ov > 0 else 0.0)      # backward's speed beside a transfer
    t = tau = min(b0, order[0][1]) if order else b0
    bwd_end = math.nan
    busy = 0.0

    def advance(dt: float, rate: float) -> None:
        """dt of real time; backward, while it runs, at `rate` of its own speed."""
        nonlocal t, tau, bwd_end
        if tau < b1 and rate > 0 and tau + dt * rate >= b1:
            bwd_end = t + (b1 - tau) / rate
            tau = b1
        elif tau < b1:
            tau += dt * rate
        t += dt

    for nb, when, *delay in order:
        if tau < min(when, b1):              # its gradients are not ready: nothing on the link
            advance(min(when, b1) - tau, 1.0)
        if delay and delay[0] > 0:           # launched later than it could be: off the link
            advance(delay[0], 1.0)
        advance(alpha, 1.0)
        busy += alpha
        rem = nb
        while rem > 0:
            if tau < b1 and p_ov > 0:
                t_done = rem * p_ov
                t_bend = (b1 - tau) / slow if slow > 0 else math.inf
                dt = min(t_done, t_bend)
                advance(dt, slow)
                busy += dt
                rem = 0 if dt == t_done else rem - dt / p_ov
            else:
                d = rem * p_alone
                advance(d, 1.0)
                busy += d
                rem = 0
    if math.isnan(bwd_end):    # backward runs on alone after the last unit (or never ran)
        bwd_end = t + (b1 - tau) if tau < b1 else b1
    return UnitRun(t if order else -math.inf, busy, bwd_end)


def simulate(buckets: Sequence[tuple[float, ...]], cost: CommCost, gpus: int,
             bandwidth_x: float = 1.0) -> tuple[float, float]:
    """(comm end from the iteration start, total time on the link): units one at a time, no
    compute beside them."""
    r = run_units(buckets, cost, gpus, bandwidth_x)
    return r.comm_end, r.busy
