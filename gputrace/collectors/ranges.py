"""Phase ranges: an NVTX range on the `gputrace` domain *and* a recorded span."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from gputrace.collectors.memory import PHASES
from gputrace.recorder import core as _recorder

_DOMAIN: Any = None
_LOADED = False
_ATTRS: dict[str, Any] = {}
_MEMORY_PHASES = frozenset(PHASES)     # phases whose start and end read the memory


def _load_domain() -> Any:
    # nvtx is imported on first use, not when a job starts (it takes ~30 ms to import).
    global _DOMAIN, _LOADED
    _LOADED = True
    try:
        import nvtx

        _DOMAIN = nvtx.get_domain("gputrace")
    except Exception:  # nvtx missing or broken: spans are still recorded
        _DOMAIN = None
    return _DOMAIN


def _attr(message: str) -> Any:
    a = _ATTRS.get(message)
    if a is None:
        dom = _DOMAIN if _LOADED else _load_domain()
        if dom is None:
            return None
        a = _ATTRS[message] = dom.get_event_attributes(message=message)
    return a


class phase:  # noqa: N801 - used like a function: `with phase("forward"):`
    """Context manager for one phase of an iteration (`io h2d forward backward update comm`
    or any `user` category). Records a span on the current recorder; a no-op without one."""

    __slots__ = ("cat", "name", "layer", "nbytes", "args", "_t0", "_rec", "_attr")

    def __init__(self, cat: str, name: str | None = None, layer: int | None = None,
                 bytes: int | None = None, args: dict[str, Any] | None = None) -> None:
        self.cat = cat
        self.name = name or cat
        self.layer = -1 if layer is None else layer
        self.nbytes = bytes
        self.args = args
        self._rec: _recorder.Recorder | None = None
        self._t0 = 0
        self._attr: Any = None

    def __enter__(self) -> phase:
        self._rec = rec = _recorder._current
        self._attr = a = _attr(self.name if self.cat == "user" else f"{self.cat}:{self.name}")
        if a is not None:
            _DOMAIN.push_range(a)
        if rec is not None:
            self._t0 = t = rec.clock.now_ns()
            if rec.memory is not None and self.cat in _MEMORY_PHASES:
                rec.memory.mark(self.cat, 0, t)   # inside the phase (see collectors.torch)
            if rec._iter_start is None and self.cat != "user":
                rec.open_iteration(t)   # the loop's first phase begins its first iteration
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        rec = self._rec
        if rec is not None:
            if rec.memory is not None and self.cat in _MEMORY_PHASES:
                rec.memory.mark(self.cat, 1, rec.clock.now_ns())
            t = rec.clock.now_ns()
            rec.span(self.cat, self.name, self._t0, t, layer=self.layer,
                     nbytes=self.nbytes, args=self.args)
        if self._attr is not None:
            _DOMAIN.pop_range()
