"""Achieved bandwidth from sampled counters, against probed peaks when known."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gputrace.analyzers.core.frame import Samples


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


def _peaks(probe: dict[str, object] | None) -> dict[str, float]:
    """Probed bandwidths by probe key."""
    out = {}
    for k, v in ((probe or {}).get("results", {}) or {}).items():  # type: ignore[union-attr]
        if isinstance(v, dict) and isinstance(v.get("bytes_per_s"), (int, float)):
            out[k] = float(v["bytes_per_s"])
    return out


_DEVICE_COUNTERS = (("pcie.rx_bytes", "h2d_pinned"), ("pcie.tx_bytes", "d2h_pinned"),
                    ("nvlink.tx_bytes", "p2p"), ("nvlink.rx_bytes", "p2p"))


def _device_links(samples: dict[str, Samples], nic: bool = False
                  ) -> list[tuple[str, str | None]]:
    """(sample key, probe key) of the PCIe, NVLink and InfiniBand byte counters, and with
    `nic` the network interfaces' (no probed peak)."""
    out: list[tuple[str, str | None]] = []
    for name in sorted(samples):
        base = name.split("@")[0]
        out += [(name, key) for prefix, key in _DEVICE_COUNTERS if base == prefix]
        if base.startswith("ib.") and base.endswith("_bytes"):
            out.append((name, "ib"))
        elif nic and base.startswith("net.") and base.endswith("_bytes"):
            out.append((name, None))
    return out


def analyze_bandwidth(samples: dict[str, Samples], lo: int, hi: int, iterations: int,
                      io_busy_s: float, probe: dict[str, object] | None) -> Bandwidth:
    """Bytes moved in the window [lo, hi) (ns); I/O rates are per second of loader work."""
    window = max((hi - lo) / 1e9, 1e-9)
    peaks = _peaks(probe)
    links = []
    disk = _delta(samples.get("proc.read_bytes"), lo, hi)
    chars = _delta(samples.get("proc.read_chars"), lo, hi)
    cache = max(chars - disk, 0.0) if chars is not None and disk is not None else None
    busy = io_busy_s if io_busy_s > 0 else window
    if disk is not None:
        links.append(Link("disk", disk, disk / busy, peaks.get("disk_read")))
    if cache is not None:
        links.append(Link("cache", cache, cache / busy, peaks.get("cache_read")))
    for name, probe_key in _device_links(samples):
        d = _delta(samples[name], lo, hi)
        if d is not None:
            links.append(Link(name, d, d / window, peaks.get(probe_key)))
    it = max(iterations, 1)
    return Bandwidth(window, links, disk / it if disk is not None else None,
                     cache / it if cache is not None else None)


@dataclass(frozen=True)
class LinkSeries:
    """Achieved bandwidth of one link in equal time bins."""

    name: str
    t_s: np.ndarray            # bin middles, seconds from the window's start
    bytes_per_s: np.ndarray
    peak_bytes_per_s: float | None


MAX_BINS = 240


def bandwidth_series(samples: dict[str, Samples], lo: int, hi: int,
                     probe: dict[str, object] | None, bins: int = MAX_BINS
                     ) -> list[LinkSeries]:
    """Bandwidth over time in [lo, hi) (ns), at most `bins` equal bins (fewer when there are
    fewer samples): storage vs page-cache reads of the traced processes, then PCIe,
    NVLink, InfiniBand and network counters that moved bytes."""
    peaks = _peaks(probe)
    counters = [s for s in samples.values() if s.unit == "bytes" and s.t.size >= 2]
    inside = max((int(np.count_nonzero((s.t >= lo) & (s.t < hi))) for s in counters), default=0)
    n = max(min(bins, inside - 1), 1)
    edges = np.linspace(lo, hi, n + 1)
    mid = (edges[:-1] + edges[1:]) / 2 - lo
    width = np.diff(edges) / 1e9

    def moved(s: Samples | None) -> np.ndarray | None:
        if s is None or s.unit != "bytes" or s.t.size < 2:
            return None
        return np.maximum(np.diff(np.interp(edges, s.t, s.value)), 0.0)

    out = []
    disk = moved(samples.get("proc.read_bytes"))
    chars = moved(samples.get("proc.read_chars"))
    if disk is not None:
        out.append(LinkSeries("disk", mid / 1e9, disk / width, peaks.get("disk_read")))
        if chars is not None:
            cache = np.maximum(chars - disk, 0.0)
            out.append(LinkSeries("cache", mid / 1e9, cache / width, peaks.get("cache_read")))
    for name, key in _device_links(samples, nic=True):
        d = moved(samples[name])
        if d is not None and d.any():
            out.append(LinkSeries(name, mid / 1e9, d / width,
                                  peaks.get(key) if key else None))
    for name in sorted(samples):   # PCIe throughput read as a rate (NVML without counters)
        s = samples[name]
        key = {"pcie.rx": "h2d_pinned", "pcie.tx": "d2h_pinned"}.get(name.split("@")[0])
        if key and s.unit == "bytes/s" and s.t.size:
            out.append(LinkSeries(name, mid / 1e9, np.interp(mid + lo, s.t, s.value),
                                  peaks.get(key)))
    return out
