"""Formats shared by the reports, findings and one-line messages."""

from __future__ import annotations


def rate(bytes_per_s: float) -> str:
    """Bytes per second as MB/s below 1 GB/s, else GB/s (decimal units, like the paper)."""
    b = bytes_per_s
    return f"{b / 1e6:.0f} MB/s" if b < 1e9 else f"{b / 1e9:.2f} GB/s"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes < 1e9 else f"{nbytes / 1e9:.2f} GB"


def count(n: int, noun: str) -> str:
    """'1 row', '2 rows', '1,024 samples'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def reason(e: BaseException) -> str:
    """An exception as the short reason in a one-line message."""
    if isinstance(e, OSError) and (e.errno or e.strerror):
        import os

        # the C library's words for the errno (pyarrow wraps them in its own)
        text = os.strerror(e.errno) if e.errno else str(e.strerror)
        return f"{text} ({e.filename})" if e.filename else text
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
