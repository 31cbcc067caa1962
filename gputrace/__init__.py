"""gputrace: where each training iteration's time goes, and why it does not scale.

    import gputrace
    with gputrace.Session("run.arrow") as s:
        for batch in s.iterate(loader):
            with s.phase("forward"): ...
            s.step()

    r = gputrace.analyze("run.arrow")       # what `gputrace analyze --json` says, as objects
    d = gputrace.diff("a.arrow", "b.arrow") # what `gputrace diff --json` says (a dict)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gputrace.collectors.ranges import phase
from gputrace.recorder.core import current
from gputrace.recorder.session import Session, iterate, record_sample, record_span, step

if TYPE_CHECKING:
    from gputrace.api import AnalysisError, DiffResult, Result, analyze, diff
    from gputrace.trace.reader import Trace

__version__ = "0.1.0"
__all__ = ["AnalysisError", "DiffResult", "Result", "Session", "analyze", "current", "diff", "iterate", "load",
           "phase", "record_sample", "record_span", "step", "__version__"]

_API = ("analyze", "diff", "Result", "DiffResult", "AnalysisError")


def __getattr__(name: str) -> Any:
    """`gputrace.analyze` and its result types, imported when first used (the analyzers
    stay out of a training job that only records)."""
    if name in _API:
        from gputrace import api

        return getattr(api, name)
    raise AttributeError(f"module 'gputrace' has no attribute {name!r}")


def load(*paths: Any) -> Trace:
    """Load a trace file, several shards or a directory of shards."""
    from gputrace.trace.reader import load as _load

    return _load(*paths)
