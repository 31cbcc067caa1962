"""CUPTI activity collector (cupti-python): kernels, memcpy, memset, sync, NVTX markers."""

from __future__ import annotations

import ctypes
import importlib.util


def availability() -> str:
    """'ok', or 'unavailable: <one-line reason>'."""
    if importlib.util.find_spec("cupti") is None:
        return "unavailable: cupti-python is not installed (pip install 'gputrace[gpu]')"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "unavailable: no CUDA driver (libcuda.so.1) on this machine"
    return "ok"
