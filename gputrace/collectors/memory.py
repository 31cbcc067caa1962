"""Memory per process, sampled by the recorder's flusher thread (nothing on the training
loop's path): the peak resident set size (getrusage's ru_maxrss), and where the job's torch
has initialized CUDA, the caching allocator's peaks per device (max_memory_allocated,
max_memory_reserved). `sample` rows of cat `memory`, names `rss_peak`, `cuda_allocated_peak`
and `cuda_reserved_peak`, in bytes, written when they grew: peaks only rise."""

from __future__ import annotations

import resource
import sys
from typing import Any

CAT = "memory"
# ru_maxrss is in KiB on Linux (bytes on macOS)
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024


def install(rec: Any) -> None:
    """Sample `rec`'s process at each of its flushes."""
    rec.flush_hooks.append(_Memory(rec).on_flush)


class _Memory:
    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.last: dict[tuple[str, int], float] = {}

    def _row(self, name: str, value: float, device: int, t_ns: int) -> tuple[Any, ...]:
        r = self.rec
        return ("sample", CAT, name, t_ns, None, float(value), "B", r.host, r.rank, r.pid,
                -1, device, -1, -1, -1, None, None, None, None, None)

    def on_flush(self, spans: list[tuple[Any, ...]], final: bool) -> list[tuple[Any, ...]]:
        # a process that records nothing else (a helper subprocess) gets no shard for this
        if not spans and not self.rec.rows_written:
            return []
        now = {("rss_peak", -1): resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               * _RSS_UNIT}
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        try:
            if cuda is not None and cuda.is_initialized():   # never initializes it
                for dev in range(cuda.device_count()):
                    now["cuda_allocated_peak", dev] = cuda.max_memory_allocated(dev)
                    now["cuda_reserved_peak", dev] = cuda.max_memory_reserved(dev)
        except Exception:  # noqa: BLE001 - a torch without these: the RSS alone
            pass
        t = self.rec.now_ns()
        rows = [self._row(name, v, dev, t) for (name, dev), v in now.items()
                if v > self.last.get((name, dev), -1)]
        self.last.update(now)
        return rows
