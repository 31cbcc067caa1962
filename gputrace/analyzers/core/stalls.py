"""Stalls: iterations of a rank whose time in no phase (t_other: not waiting for data, not a
copy, forward, backward, update, collective or the framework's own work) is THRESHOLD_S or
more, named with the iteration (not where the trace has no iteration marks). A rank that stood still there (a sleep, a blocking call
outside what is recorded, evaluation or checkpointing not yet told apart) is often the one
its peers wait for in their next collective (analyzers.extras.hangs names that side)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gputrace.analyzers.findings.rules import Finding

THRESHOLD_S = 5.0
NAMED = 3   # iterations named in the finding; the rest counted


def stalls(rs: Any, threshold_s: float = THRESHOLD_S) -> list[tuple[int, float, float]]:
    """(step, time in no phase, t_iter) in seconds of each iteration over the threshold."""
    other = rs.terms.get("t_other")
    if other is None or not len(other) or rs.iterations.synthetic:
        return []     # no iteration marks: the one window is the whole trace, not a stall
    t_iter = rs.terms["t_iter"]
    at = np.flatnonzero(np.asarray(other) >= threshold_s)
    return [(int(rs.iterations.step[i]), float(other[i]), float(t_iter[i])) for i in at]


def findings(rs: Any, threshold_s: float = THRESHOLD_S) -> list[Finding]:
    """One `stall` finding for a rank's stalls, the longest named first."""
    found = sorted(stalls(rs, threshold_s), key=lambda s: -s[1])
    if not found:
        return []
    named = ", ".join(f"iteration {step} ({o:.2f} s of its {t:.2f} s)"
                      for step, o, t in found[:NAMED])
    more = f" and {len(found) - NAMED} more" if len(found) > NAMED else ""
    return [Finding("stall", "high",
                    f"Stall over {threshold_s:g} s that no recorded phase explains (not data, "
                    f"copies, forward, backward, update or a collective): {named}{more}")]
