"""The trace file format v1: the only package both collectors and analyzers import."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Trace": "reader", "load": "reader", "merge_metadata": "reader",
    "COLUMN_NAMES": "schema", "FORMAT": "schema", "VERSION": "schema",
    "TraceFormatError": "schema", "read_metadata": "schema",
    "Row": "writer", "TraceWriter": "writer", "write_trace": "writer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy, so that the in-process bootstrap does not import pyarrow before it writes.
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"gputrace.trace.{mod}"), name)
