"""Findings about memory (from analyze --json's `memory`, analyzers.extras.memory): a rank that
comes within CAPACITY_MARGIN of its device's memory (its GPU's total, or its host's
MemTotal for the resident set of the host's ranks together), and a rank that holds far more
than the others (IMBALANCE times the median of the others' peaks)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from gputrace.analyzers.findings.rules import Finding

CAPACITY_MARGIN = 0.10
IMBALANCE = 1.5


def _gib(v: float) -> str:
    return f"{v / 2.0 ** 30:.2f} GiB"


def _at(phase: str | None) -> str:
    return f" (in {phase})" if phase else ""


def memory_findings(m: dict[str, Any]) -> list[Finding]:
    if m.get("unavailable"):
        return []
    ranks = {int(k): v for k, v in (m.get("ranks") or {}).items()}
    out: list[Finding] = []
    for r, v in sorted(ranks.items()):
        peak, total = v.get("cuda_allocated_peak_bytes"), v.get("cuda_total_bytes")
        if peak and total and peak >= (1 - CAPACITY_MARGIN) * total:
            out.append(Finding(
                "memory_near_capacity", "high",
                f"Rank {r} allocated up to {_gib(peak)} of its GPU's {_gib(total)} "
                f"({peak / total:.0%}){_at(v.get('cuda_allocated_peak_phase'))}: within "
                f"{CAPACITY_MARGIN:.0%} of running out; a larger batch or model will not fit."))
    # a host's ranks share its memory: their peaks together against its MemTotal
    hosts: dict[str, list[int]] = defaultdict(list)
    for r, v in ranks.items():
        if v.get("rss_peak_bytes") and v.get("host_total_bytes"):
            hosts[v.get("host") or ""].append(r)
    for host, rs in sorted(hosts.items()):
        total = max(ranks[r]["host_total_bytes"] for r in rs)
        held = sum(ranks[r]["rss_peak_bytes"] for r in rs)
        if held >= (1 - CAPACITY_MARGIN) * total:
            who = f"rank {rs[0]}" if len(rs) == 1 else \
                f"ranks {', '.join(map(str, sorted(rs)))} together"
            out.append(Finding(
                "memory_near_capacity", "high",
                f"On {host or 'its host'}, {who} peaked at {_gib(held)} resident of "
                f"{_gib(total)} ({held / total:.0%}): within {CAPACITY_MARGIN:.0%} of the "
                "host's memory; the machine may swap or kill a rank."))
    for g in m.get("gpus") or []:
        used, total = g.get("used_peak_bytes"), g.get("total_bytes")
        if used and total and used >= (1 - CAPACITY_MARGIN) * total:
            out.append(Finding(
                "memory_near_capacity", "high",
                f"GPU {g['device']} on {g.get('host') or 'its host'} had {_gib(used)} of "
                f"{_gib(total)} in use at its peak ({used / total:.0%}, as NVML sampled "
                f"it): within {CAPACITY_MARGIN:.0%} of its memory."))
    out += _imbalance(ranks, "cuda_allocated_peak_bytes", "cuda_allocated_peak_phase",
                      "allocated on its GPU")
    if not any(f.id == "memory_imbalance" for f in out):
        out += _imbalance(ranks, "rss_peak_bytes", "rss_peak_phase", "resident")
    return out


def _imbalance(ranks: dict[int, dict[str, Any]], key: str, phase: str,
               what: str) -> list[Finding]:
    """Each rank whose peak is over IMBALANCE times the median of the other ranks'."""
    peaks = {r: v[key] for r, v in ranks.items() if v.get(key)}
    if len(peaks) < 2:
        return []
    out = []
    for r, p in sorted(peaks.items()):
        others = statistics.median(v for k, v in peaks.items() if k != r)
        if p > IMBALANCE * others:
            out.append(Finding(
                "memory_imbalance", "moderate",
                f"Rank {r} peaked at {_gib(p)} {what}{_at(ranks[r].get(phase))}, "
                f"{p / others:.1f}x the median of the other ranks ({_gib(others)}): it "
                "holds something the others do not (a gathered output, a rank-0 copy, "
                "uneven shards); the job fits only as well as its largest rank."))
    return out
