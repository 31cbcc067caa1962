"""DeepSpeed ZeRO's own settings as what-ifs of the sharded replay (analyzers.parallel.sharded.shardsim):
the gradient reduction re-bucketed at another `reduce_bucket_size`, and `overlap_comm`
turned on or off. Pure functions of a measured Timeline and plain numbers.

Re-bucketing follows DeepSpeed's gradient buckets at the granularity of the recorded
backward layers: in the order gradients become ready, a layer whose gradients would take
the bucket past `reduce_bucket_size` elements reduces the bucket first (issued when that
layer's gradients are ready), the last bucket is reduced when the backward ends; where the
run reduced every bucket after its backward (ZeRO-1), the new buckets are too. A
collective's service time is alpha + beta x bytes (Cost: the cost of a call and of a byte,
fitted on the run's own collectives)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from gputrace.analyzers.findings.sanity import MIN_FIT_BYTES
from gputrace.analyzers.parallel.sharded import shardsim as sim

DEFAULT_BUCKET = 500_000_000   # DeepSpeed's reduce_bucket_size
ASSUMPTIONS = (
    "reduce_bucket_size: gradients fill buckets at the recorded layers' granularity, in the "
    "order they became ready; a bucket's service time is alpha + beta x its bytes (alpha the "
    "cost of one call, beta of one byte, fitted on the run's own collectives: see cost), "
    "also where it is issued right behind another (ZeRO-1's, all after the backward)",
    "overlap_comm: with it, a gradient reduction runs on its own stream beside the backward; "
    "without it, the backward waits for each; synchronous collectives (gloo's on the CPU) "
    "block the backward either way, and DeepSpeed's reductions are the same calls with it "
    "or without, so there the replay gives no change",
)


@dataclass(frozen=True)
class Cost:
    """A collective's service time, alpha_s + beta_s x bytes, and how it was had."""

    alpha_s: float
    beta_s: float
    how: str

    def of(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s * nbytes


def fit(svc: np.ndarray, nbytes: np.ndarray, small_svc: np.ndarray,
        small_bytes: np.ndarray, least: float = MIN_FIT_BYTES) -> Cost | None:
    """alpha and beta from the run's collectives of one kind (`svc`, `nbytes`: its gradient
    reductions; `small_*`: its collectives of a few bytes, the cost of a call): a least-squares
    line where the sizes differ and reach `least`, else alpha the small collectives'
    mean and beta the rest per byte; None when the reductions never reach `least` (a
    cost per byte fitted on latency alone: sanity.fit_too_small)."""
    ok = (nbytes > 0) & np.isfinite(svc) & (svc >= 0)
    sok = np.isfinite(small_svc) & (small_svc >= 0) & (small_bytes >= 0)
    x = np.concatenate([nbytes[ok], small_bytes[sok]])
    y = np.concatenate([svc[ok], small_svc[sok]])
    if not ok.any() or float(nbytes[ok].max()) < least:
        return None
    n, total = int(ok.sum()), float(nbytes[ok].sum())
    sizes = np.unique(np.round(x, -3))
    if sizes.size >= 2:
        beta, alpha = np.polyfit(x, y, 1)
        if alpha >= 0 and beta > 0:
            return Cost(float(alpha), float(beta),
                        f"fitted on {x.size} collectives of {sizes.size} sizes, "
                        f"{x.min():,.0f} to {x.max():,.0f} bytes")
    alpha = float(np.mean(small_svc[sok])) if sok.any() else 0.0
    alpha = min(alpha, float(svc[ok].sum()) / n)
    beta = (float(svc[ok].sum()) - n * alpha) / total
    how = (f"alpha the mean of {int(sok.sum())} collectives of a few bytes, beta the rest "
           "per byte" if sok.any() else "no collective of another size: alpha not known, "
           "taken as 0")
    return Cost(alpha, beta, how)


def settings(md: dict) -> dict:
    """The engine's settings a job's processes wrote (metadata `deepspeed`, in the merged
    trace's shards), {} when none."""
    for m in [md, *(md.get("shards") or [])]:
        d = m.get("deepspeed") if isinstance(m, dict) else None
        if isinstance(d, dict):
            return {k: v for k, v in d.items() if isinstance(v, (bool, int, float, str))}
    return {}


def buckets(layers: tuple[tuple[float, float], ...], cap_bytes: float, after: bool,
            end: float) -> list[tuple[float, float]]:
    """(issue offset, gradient bytes) of each bucket under DeepSpeed's rule; `after`: every
    bucket issued when the backward's compute ends (`end`)."""
    out: list[tuple[float, float]] = []
    cur = 0.0
    for off, b in layers:
        if cur and cur + b > cap_bytes:
            out.append((end if after else off, cur))
            cur = 0.0
        cur += b
    if cur:
        out.append((end, cur))
    return out


def rebucket(tl: sim.Timeline, new: list[tuple[float, float]], cost: Cost,
             blocking: bool) -> sim.Timeline:
    """The timeline with its backward's reductions replaced by `new` (issue offset, bytes
    of the call), each of service cost.of(bytes), also one issued right behind another
    (ZeRO-1's, all after the backward: over gloo, 5 such buckets measured 5-8 % slower than
    1 in a 50 ms iteration, about one alpha per call more; bench/README.md)."""
    side = tl.backward
    total = float(sum(side.compute_s))
    gathers: list[tuple[float, float, int]] = []   # (offset, service, unit)
    off = 0.0
    for j, c in enumerate(side.compute_s):
        if side.gather_s[j] is not None and j:
            gathers.append((off, side.gather_s[j], side.units[j] if side.units else -1))
        off += c
    events = sorted([(o, 1, g, u) for o, g, u in gathers] +
                    [(min(o, total), 0, cost.of(b), -1) for o, b in new],
                    key=lambda e: (e[0], e[1]))
    comp, gs, rs, us, blk = [], [], [], [], []
    cur_g: float | None = side.gather_s[0] if side.gather_s else None
    cur_u = side.units[0] if side.units else -1
    prev = 0.0
    for o, is_gather, svc, u in events:
        comp.append(max(o - prev, 0.0))
        gs.append(cur_g)
        us.append(cur_u)
        if is_gather:
            rs.append(None)
            blk.append(False)
            cur_g, cur_u = svc, u
        else:
            rs.append(svc)
            blk.append(blocking)
            cur_g, cur_u = None, -1
        prev = max(prev, o)
    comp.append(max(total - prev, 0.0))
    gs.append(cur_g)
    rs.append(None)
    us.append(cur_u)
    blk.append(False)
    return replace(tl, backward=sim.Side(side.pre_s, comp, gs, rs, us, blk))


def sizes(now: int | None, elems: float) -> list[int]:
    """The sizes a bucket setting is tried at: a quarter and four times the engine's (and
    DeepSpeed's default when four times still splits); a quarter and a sixteenth of the
    elements when the engine's held them all in one bucket."""
    return sorted({int(x) for x in (
        [now // 4, now * 4] + ([DEFAULT_BUCKET] if now * 4 < elems else [])
        if now and now < elems else [elems / 4, elems / 16]) if x >= 1 and x != now})


def scenarios(tls: list[sim.Timeline], cost: Cost, red_bytes: np.ndarray,
              engine: dict, sync: bool
              ) -> list[tuple[str, dict, list[sim.Timeline], list[sim.Timeline]]]:
    """(label, settings, the timelines under them, the timelines they are compared with)
    for the reduce_bucket_size and overlap_comm what-ifs; none when the run recorded no
    backward layers or reductions. A bucket size is compared with the measured size
    re-bucketed the same way (the model's own error cancels), when that size is known."""
    if not tls or not red_bytes.size or not all(tl.layers for tl in tls):
        return []
    elem = int(engine.get("element_size") or 4)
    cap = engine.get("reduce_bucket_size")
    grad = float(np.mean([sum(b for _, b in tl.layers) for tl in tls]))
    if grad <= 0 or not np.isfinite(grad):
        return []
    wire = float(red_bytes.sum()) / len(tls) / grad   # bytes reduced per gradient byte
    overlap = bool(engine.get("overlap_comm", False))
    blocking = True if sync else not overlap
    # ZeRO-1 reduces after the backward: every measured reduction after the last layer
    after = all(_reduce_offsets(tl) and min(_reduce_offsets(tl)) >= tl.layers[-1][0] - 1e-9
                for tl in tls) and int(engine.get("stage", 2)) == 1
    now = int(cap) if isinstance(cap, (int, float)) and cap > 0 else None

    def at(c: float) -> list[sim.Timeline]:
        return [rebucket(tl, [(o, b * wire) for o, b in buckets(
            tl.layers, c * elem, after, float(sum(tl.backward.compute_s)))],
            cost, blocking) for tl in tls]

    def count(c: float) -> int:   # buckets per iteration
        return round(float(np.mean([len(buckets(tl.layers, c * elem, after, 0.0))
                                    for tl in tls])))

    ref = at(now) if now else tls
    out = []
    for c in sizes(now, grad / elem):
        n = count(c)
        out.append((f"reduce_bucket_size={c:.3g} ({n} bucket{'' if n == 1 else 's'})",
                    {"reduce_bucket_size": c, "buckets": n}, at(c), ref))
    flip = not overlap
    out.append((f"overlap_comm={flip}", {"overlap_comm": flip},
                [replace(tl, backward=replace(tl.backward, blocking=[
                    (True if sync else not flip) if r is not None else False
                    for r in tl.backward.reduce_s])) for tl in tls], tls))
    return out


def gathers(engine: dict, calls: float, nbytes: float, world: int, cost: Cost | None,
            grad_bytes: float = 0.0) -> list[tuple[str, dict, float | None, str | None]]:
    """allgather_bucket_size (stages 1-2: the step's all-gathers of the updated
    partitions, `calls` of `nbytes` per iteration, this rank's input; tried at the sizes
    the gradients' bytes give reduce_bucket_size, else the gathered): (label, settings, the
    change of the iteration in s or None, why withheld or None). With deepspeed.comm's
    all_gather_into_tensor (recorded: `all_gather_into_tensor`) DeepSpeed gathers each
    parameter group in one call whatever the size; without it, in max(1, partition x N //
    size) calls of the same bytes in all, each costing one more alpha."""
    if int(engine.get("stage", 0)) not in (1, 2) or calls <= 0 or nbytes <= 0:
        return []
    elem = int(engine.get("element_size") or 4)
    now = engine.get("allgather_bucket_size")
    now = int(now) if isinstance(now, (int, float)) and now > 0 else None
    into = engine.get("all_gather_into_tensor")
    out: list[tuple[str, dict, float | None, str | None]] = []
    for c in sizes(now, (grad_bytes or nbytes * world) / elem):
        if into is True:
            n, why = round(calls), None
        elif into is False and cost is not None:
            n, why = max(1, int(nbytes / elem * world // c)), None
        else:
            n = 0
            why = ("the recording does not say whether deepspeed.comm has "
                   "all_gather_into_tensor (with it the step gathers each parameter group in "
                   "one call whatever allgather_bucket_size; without it, in buckets of that "
                   "size)" if into is None else
                   "no cost per call and per byte fitted for the step's all-gathers")
        delta = None if why else (n - calls) * (cost.alpha_s if cost else 0.0)
        out.append((f"allgather_bucket_size={c:.3g} ({n} all-gather{'' if n == 1 else 's'})"
                    if not why else f"allgather_bucket_size={c:.3g}",
                    {"allgather_bucket_size": c, "gathers": n}, delta, why))
    return out


def _reduce_offsets(tl: sim.Timeline) -> list[float]:
    out, off = [], 0.0
    for c, r in zip(tl.backward.compute_s, tl.backward.reduce_s, strict=False):
        off += c
        if r is not None:
            out.append(off)
    return out
