"""The files a save wrote: what is at a path (a file, or each file under a folder) with its
size and modification time, read before and after the save. No torch, no TensorFlow."""

from __future__ import annotations

import os
from typing import Any


def files_at(path: Any) -> dict[str, tuple[int, int]]:
    """The file at `path`, or each file under it: (size, mtime ns); {} where none is."""
    if not isinstance(path, (str, os.PathLike)):
        return {}
    path = os.fspath(path)
    if os.path.isfile(path):
        st = os.stat(path)
        return {path: (st.st_size, st.st_mtime_ns)}
    out: dict[str, tuple[int, int]] = {}
    for d, _, fs in os.walk(path):
        for f in fs:
            p = os.path.join(d, f)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out[p] = (st.st_size, st.st_mtime_ns)
    return out
