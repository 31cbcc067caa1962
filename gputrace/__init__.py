"""gputrace: where each training iteration's time goes, and why it does not scale.

    import gputrace
    with gputrace.Session("run.arrow") as s:
        for batch in s.iterate(loader):
            with s.phase("forward"): ...
            s.step()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gputrace.collectors.ranges import phase
from gputrace.recorder import current
from gputrace.session import Session, iterate, record_sample, record_span, step

if TYPE_CHECKING:
    from gputrace.trace.reader import Trace

__version__ = "0.1.0"
__all__ = ["Session", "current", "iterate", "load", "phase", "record_sample", "record_span",
           "step", "__version__"]


def load(*paths: Any) -> Trace:
    """Load a trace file, several shards or a directory of shards."""
    from gputrace.trace.reader import load as _load

    return _load(*paths)
