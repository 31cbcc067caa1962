"""A GPU trace's device busy and idle time, the line given where its phases are unknown (an
import of another tool's trace without forward, backward or update ranges)."""

from __future__ import annotations

from gputrace.analyzers import RankAnalysis


def phases_unknown(ra: RankAnalysis) -> bool:
    """No forward, backward or update time was found."""
    return all(ra.breakdown[k].mean <= 0 for k in ("t_f", "t_b", "t_u") if k in ra.breakdown)


def busy_line(ra: RankAnalysis) -> str | None:
    """"GPU busy X ms (Y %) ..." for a GPU trace whose phases are unknown, else None."""
    d = ra.device_busy
    t_iter = ra.breakdown["t_iter"].mean
    if d is None or not t_iter > 0 or not phases_unknown(ra):
        return None
    busy, idle = d["busy_s"], d["idle_s"]
    return (f"GPU busy {busy * 1e3:.1f} ms ({busy / t_iter:.0%}) and idle {idle * 1e3:.1f} ms "
            "of each iteration: no forward, backward or update phase was found, so the "
            "device's time is not split by phase")
