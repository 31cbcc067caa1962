"""Formats shared by the reports, findings and one-line messages, and the sizes both sides
read back from text (parse_bytes; AnalysisError: the one line a bad value gets)."""

from __future__ import annotations

import math
import re
from typing import Any


class AnalysisError(ValueError):
    """Bad input (a missing or foreign file, a wrong option, a size that cannot be read):
    the one line the command line prints."""


def rate(bytes_per_s: float) -> str:
    """Bytes per second as MB/s below 1 GB/s, else GB/s (decimal units, like the paper)."""
    b = bytes_per_s
    return f"{b / 1e6:.0f} MB/s" if b < 1e9 else f"{b / 1e9:.2f} GB/s"


# the fewest bytes mb() shows as more than "0.0 MB": a figure under it says nothing
MB_SHOWN = 0.05e6


# the what-if's buckets where none were measured (one process): DDP's, a first bucket of
# 1 MiB, then 25 MiB ones (a row of bucket_cap_mb=25 has no small first bucket)
DDP_DEFAULT = "DDP's default (1 MiB first, then 25)"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes < 1e9 else f"{nbytes / 1e9:.2f} GB"


def ranges(ks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for k in ks:
        if out and k == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{k}"
        else:
            out.append(str(k))
    return ", ".join(out)


def count(n: int, noun: str) -> str:
    """'1 row', '2 rows', '1,024 samples'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def write_failed(w: Any, e: BaseException) -> None:
    """Keep a file writer's first error (`w.error`, `w.errno`) and say it once on stderr
    unless `w.quiet` (its owner says it then)."""
    if w.error is None:
        w.error = reason(e)
        w.errno = getattr(e, "errno", 0) or 0
        if not w.quiet:
            import sys

            print(f"gputrace: cannot write {w.path}: {w.error}; this process records "
                  "nothing more, what it wrote stays readable", file=sys.stderr)


def reason(e: BaseException) -> str:
    """An exception as the short reason in a one-line message."""
    if isinstance(e, OSError) and (e.errno or e.strerror):
        import os

        # the C library's words for the errno (pyarrow wraps them in its own)
        text = os.strerror(e.errno) if e.errno else str(e.strerror)
        return f"{text} ({e.filename})" if e.filename else text
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1024, "mi": 1024**2,
          "gi": 1024**3, "ti": 1024**4}


def parse_bytes(text: str, what: str, per_second: bool = False) -> float:
    """'64MiB', '1GB', '7GB/s', '56Gb/s' (small b: bits), '12.5e9' -> bytes (per second)."""
    rate = r"(?:/s|ps)?" if per_second else ""
    m = re.fullmatch(rf"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?([bB])?{rate}\s*", text,
                     re.IGNORECASE)
    if not m:
        example = "7GB/s or 56Gb/s" if per_second else "64MiB or 1GB"
        raise AnalysisError(f"cannot read {what} {text!r}; write e.g. {example}")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if m.group(3) == "b":  # bits
        value /= 8
    if not 0 < value < math.inf:
        raise AnalysisError(f"{what} must be positive and finite, not {text!r}")
    return value
