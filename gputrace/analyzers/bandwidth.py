"""Achieved bandwidth from sampled counters, against probed peaks when known."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gputrace.analyzers.frame import Samples


@dataclass(frozen=True)
class Link:
    name: str
    bytes: float
    bytes_per_s: float
    peak_bytes_per_s: float | None

    @property
    def fraction_of_peak(self) -> float | None:
        if not self.peak_bytes_per_s:
            return None
        return self.bytes_per_s / self.peak_bytes_per_s


@dataclass(frozen=True)
class Bandwidth:
    window_s: float
    links: list[Link]
    disk_bytes_per_iter: float | None
    cache_bytes_per_iter: float | None


def _at(s: Samples, t: float) -> float:
    return float(np.interp(t, s.t, s.value))


def _delta(s: Samples | None, lo: int, hi: int) -> float | None:
    if s is None or s.t.size < 2 or s.unit != "bytes":
        return None
    return max(_at(s, hi) - _at(s, lo), 0.0)


def analyze_bandwidth(samples: dict[str, Samples], lo: int, hi: int, iterations: int,
                      io_busy_s: float, probe: dict[str, object] | None) -> Bandwidth:
    """Bytes moved in the window [lo, hi) (ns); I/O rates are per second of loader work."""
    window = max((hi - lo) / 1e9, 1e-9)
    peaks = {}
    for k, v in ((probe or {}).get("results", {}) or {}).items():
        if isinstance(v, dict) and isinstance(v.get("bytes_per_s"), (int, float)):
            peaks[k] = float(v["bytes_per_s"])
    links = []
    disk = _delta(samples.get("proc.read_bytes"), lo, hi)
    chars = _delta(samples.get("proc.read_chars"), lo, hi)
    cache = max(chars - disk, 0.0) if chars is not None and disk is not None else None
    busy = io_busy_s if io_busy_s > 0 else window
    if disk is not None:
        links.append(Link("disk", disk, disk / busy, peaks.get("disk_read")))
    if cache is not None:
        links.append(Link("cache", cache, cache / busy, peaks.get("cache_read")))
    for name in sorted(samples):
        base = name.split("@")[0]
        for prefix, probe_key in (("pcie.rx_bytes", "h2d_pinned"), ("pcie.tx_bytes", "d2h_pinned"),
                                  ("nvlink.tx_bytes", "p2p"), ("nvlink.rx_bytes", "p2p")):
            if base == prefix:
                d = _delta(samples[name], lo, hi)
                if d is not None:
                    links.append(Link(name, d, d / window, peaks.get(probe_key)))
        if base.startswith("ib.") and base.endswith("_bytes"):
            d = _delta(samples[name], lo, hi)
            if d is not None:
                links.append(Link(name, d, d / window, peaks.get("ib")))
    it = max(iterations, 1)
    return Bandwidth(window, links, disk / it if disk is not None else None,
                     cache / it if cache is not None else None)
