"""DeepSpeed ZeRO's own settings as what-ifs of the sharded replay (analyzers.shardsim):
the gradient reduction re-bucketed at another `reduce_bucket_size`, and `overlap_comm`
turned on or off. Pure functions of a measured Timeline and plain numbers.

Re-bucketing follows DeepSpeed's gradient buckets at the granularity of the recorded
backward layers: in the order gradients become ready, a layer whose gradients would take
the bucket past `reduce_bucket_size` elements reduces the bucket first (issued when that
layer's gradients are ready), the last bucket is reduced when the backward ends; where the
run reduced every bucket after its backward (ZeRO-1), the new buckets are too. A bucket's
service time is its bytes at the run's own reductions' time per byte."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gputrace.analyzers import shardsim as sim

DEFAULT_BUCKET = 500_000_000   # DeepSpeed's reduce_bucket_size
ASSUMPTIONS = (
    "reduce_bucket_size: gradients fill buckets at the recorded layers' granularity, in the "
    "order they became ready; a bucket's service time is its bytes at the run's own "
    "reductions' time per byte; not modeled: the cost of one more call, and the rendezvous "
    "of the ranks each synchronous reduction inside the backward adds (ZeRO-2 over gloo: 5 "
    "buckets measured 13-16 % slower than 1; ZeRO-1, which reduces after its backward, the "
    "same)",
    "overlap_comm: with it, a gradient reduction runs on its own stream beside the backward; "
    "without it, the backward waits for each; synchronous collectives (gloo's on the CPU) "
    "block the backward either way, so there the replay gives no change; DeepSpeed's other "
    "code path with it (its buffers) is not modeled (ZeRO-2 over gloo measured 13 % faster "
    "with it)",
)


def settings(md: dict) -> dict:
    """The engine's settings a job's processes wrote (metadata `deepspeed`, in the merged
    trace's shards), {} when none."""
    for m in [md, *(md.get("shards") or [])]:
        d = m.get("deepspeed") if isinstance(m, dict) else None
        if isinstance(d, dict):
            return {k: v for k, v in d.items() if isinstance(v, (bool, int, float, str))}
    return {}


def per_byte(svc: np.ndarray, nbytes: np.ndarray) -> float:
    """Seconds per byte of the run's gradient reductions (their service over their bytes;
    the cost of a call is not modeled: see ASSUMPTIONS)."""
    ok = (nbytes > 0) & np.isfinite(svc) & (svc >= 0)
    total = float(nbytes[ok].sum())
    return float(svc[ok].sum()) / total if total > 0 else 0.0


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


def rebucket(tl: sim.Timeline, new: list[tuple[float, float]], byte_s: float,
             blocking: bool) -> sim.Timeline:
    """The timeline with its backward's reductions replaced by `new` (issue offset, bytes
    on the wire), each of service byte_s x bytes."""
    side = tl.backward
    total = float(sum(side.compute_s))
    gathers: list[tuple[float, float, int]] = []   # (offset, service, unit)
    off = 0.0
    for j, c in enumerate(side.compute_s):
        if side.gather_s[j] is not None and j:
            gathers.append((off, side.gather_s[j], side.units[j] if side.units else -1))
        off += c
    events = sorted([(o, 1, g, u) for o, g, u in gathers] +
                    [(min(o, total), 0, byte_s * b, -1) for o, b in new],
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


def scenarios(tls: list[sim.Timeline], red_svc: np.ndarray, red_bytes: np.ndarray,
              engine: dict, sync: bool
              ) -> list[tuple[str, dict, list[sim.Timeline], list[sim.Timeline]]]:
    """(label, settings, the timelines under them, the timelines they are compared with)
    for the reduce_bucket_size and overlap_comm what-ifs; none when the run recorded no
    backward layers or reductions. A bucket size is compared with the measured size
    re-bucketed the same way (the model's own error cancels), when that size is known."""
    if not tls or not red_svc.size or not all(tl.layers for tl in tls):
        return []
    byte_s = per_byte(red_svc, red_bytes)
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
    elems = grad / elem
    now = int(cap) if isinstance(cap, (int, float)) and cap > 0 else None
    # a quarter and four times the measured size (and DeepSpeed's default, one bucket
    # here, when that is still several); a quarter and a sixteenth of the gradients when
    # one bucket held them all
    caps = sorted({int(x) for x in (
        [now // 4, now * 4] + ([DEFAULT_BUCKET] if now * 4 < elems else [])
        if now and now < elems else [elems / 4, elems / 16]) if x >= 1 and x != now})

    def at(c: float) -> list[sim.Timeline]:
        return [rebucket(tl, [(o, b * wire) for o, b in buckets(
            tl.layers, c * elem, after, float(sum(tl.backward.compute_s)))],
            byte_s, blocking) for tl in tls]

    def count(c: float) -> int:   # buckets per iteration
        return round(float(np.mean([len(buckets(tl.layers, c * elem, after, 0.0))
                                    for tl in tls])))

    ref = at(now) if now else tls
    out = []
    for c in caps:
        n = count(c)
        out.append((f"reduce_bucket_size={c:.3g} ({n} bucket{'' if n == 1 else 's'})",
                    {"reduce_bucket_size": c, "buckets": n}, at(c), ref))
    flip = not overlap
    out.append((f"overlap_comm={flip}", {"overlap_comm": flip},
                [replace(tl, backward=replace(tl.backward, blocking=[
                    (True if sync else not flip) if r is not None else False
                    for r in tl.backward.reduce_s])) for tl in tls], tls))
    return out


def _reduce_offsets(tl: sim.Timeline) -> list[float]:
    out, off = [], 0.0
    for c, r in zip(tl.backward.compute_s, tl.backward.reduce_s, strict=False):
        off += c
        if r is not None:
            out.append(off)
    return out
