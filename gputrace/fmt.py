"""Number formats shared by the reports and findings."""

from __future__ import annotations


def rate(bytes_per_s: float) -> str:
    """Bytes per second as MB/s below 1 GB/s, else GB/s (decimal units, like the paper)."""
    b = bytes_per_s
    return f"{b / 1e6:.0f} MB/s" if b < 1e9 else f"{b / 1e9:.2f} GB/s"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes < 1e9 else f"{nbytes / 1e9:.2f} GB"
