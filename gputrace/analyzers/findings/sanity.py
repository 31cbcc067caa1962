"""Where an analysis stops short of an absurd figure: a prediction far outside what the run
measured, a comm cost fitted on too few bytes to say what a byte costs, an all-reduce
efficiency over 100 %. Each is withheld with one sentence saying why."""

from __future__ import annotations

import math
from typing import Any

from gputrace.analyzers.core import collective_totals as ct
from gputrace.fmt import mb, rate

# A predicted iteration over this many times the measured one is withheld: the models replay
# or scale what the run measured, and that far from it they are not checked by anything.
MAX_RATIO = 3.0
# A per-byte comm cost is fitted only on at least this much comm per iteration: below it a
# collective's time is its latency and its wait for peers, not its bytes, and a cost per
# byte fitted on it turns a bucket of megabytes into minutes.
MIN_FIT_BYTES = 1e6


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


def far_off(t_iter: float, measured: float) -> str | None:
    """Why a predicted iteration is withheld, or None when it may be shown."""
    if not measured > 0 or not math.isfinite(t_iter) or t_iter <= MAX_RATIO * measured:
        return None
    return (f"{_ms(t_iter)} predicted, over {MAX_RATIO:g}x the measured {_ms(measured)}: "
            "too far from what the run measured to be trusted")


def fit_too_small(bytes_per_iteration: float) -> str | None:
    """Why a comm cost fitted on this much comm per iteration is not used, or None."""
    if bytes_per_iteration >= MIN_FIT_BYTES:
        return None
    return (f"the measured gradient comm moves {bytes_per_iteration:,.0f} bytes per "
            f"iteration, under the {mb(MIN_FIT_BYTES)} a cost per byte is fitted on (its "
            "time is latency and waiting for peers, not bytes), so no what-if is predicted "
            "from it")


def eq12_over(eff: float, grad_bytes: float, n: int, t_comm: float, link: float) -> str:
    """What is inconsistent when eq. 12 gives an all-reduce efficiency over 100 %."""
    head = f"eq. 12 gives {eff:.0%}, over 100 %, so it is not shown: "
    ring = 2.0 * (n - 1) / n if n > 1 else 0.0
    bus = ring * grad_bytes / t_comm
    if n > 1 and bus <= link:
        return head + (
            f"it counts the gradient bytes of all {n} ranks ({n} x {mb(grad_bytes)}) as "
            f"crossing the link in the {_ms(t_comm)} of comm per iteration, while a ring "
            f"all-reduce moves 2(N-1)/N = {ring:.2f} x them per rank; counted so, the "
            f"measured comm ran at {bus / link:.0%} of the link's {rate(link)}")
    need = f"needs {rate(bus)} of bus bandwidth" if n > 1 else \
        f"is {rate(grad_bytes / t_comm)}"
    return head + (
        f"the measured comm is faster than the stated link allows ({mb(grad_bytes)} of "
        f"gradients all-reduced by {n} rank{'s' if n != 1 else ''} in {_ms(t_comm)} per "
        f"iteration {need}; the link is given as {rate(link)}): the link bandwidth (the "
        "probe's all-reduce bus bandwidth, or --link-bandwidth) or the gradient byte counts "
        "are wrong")


def _tf_unprofiled(md: dict[str, Any]) -> bool:
    """A TensorFlow job recorded with its profiler off (a multi-worker job by default): its
    collectives are seen only through that profiler."""
    tf = (md.get("collectors") or {}).get("tensorflow")
    return isinstance(tf, dict) and tf.get("profiler_steps") == "off"


def comm_missing(parts: list[Any], world: int, md: dict[str, Any]) -> str | None:
    """Why a multi-rank run gives no comm figure (its ranks' parts: RankPart), or None: its
    analyzed iterations hold no collective (whatever was recorded outside them), or none
    that is gradient comm; with what the processes' torch collectors noted."""
    if world < 2:
        return None
    if not any(p.collectives.in_iterations for p in parts):
        why = ct.missing_message(world, tf_unprofiled=_tf_unprofiled(md),
                                  outside=max(p.collectives.recorded for p in parts))
    elif not any(p.model.units or p.sharded is not None for p in parts):
        most = max(parts, key=lambda p: p.collectives.in_iterations)
        why = ct.gradient_missing_message(world, most.collectives.kinds)
    else:
        return None
    notes = _torch_notes(md)
    return why + (f" (the recording noted: {'; '.join(notes)})" if notes else "")


def _torch_notes(md: dict[str, Any]) -> list[str]:
    """What the processes' torch collectors noted of their recording (metadata torch.notes),
    each once."""
    out: list[str] = []
    for m in [md, *(md.get("shards") or [])]:
        t = m.get("torch") if isinstance(m, dict) else None
        for n in (t.get("notes") or []) if isinstance(t, dict) else []:
            if isinstance(n, str) and n not in out:
                out.append(n)
    return out
