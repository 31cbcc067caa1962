"""Where an analysis stops short of an absurd figure: an all-reduce efficiency over 100 %
is withheld with one sentence saying what does not add up."""

from __future__ import annotations

from gputrace.fmt import mb, rate


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


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
