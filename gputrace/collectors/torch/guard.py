"""A torch hook of gputrace's that fails is one line on stderr, never the training's
exception: the wrapper every hook and patch of the torch collector goes through."""

from __future__ import annotations

import functools
from typing import Any

from gputrace.collectors import instrumentation_failed
from gputrace.recorder.core import Recorder

_failed: list[str] = []
_rec: Recorder | None = None


def set_recorder(rec: Recorder | None) -> None:
    """The recorder a failure is noted in (its collector status says what was lost)."""
    global _rec
    _rec = rec


def _hook_failed(where: str, e: Exception) -> None:
    instrumentation_failed("torch", "torch", where, e, _failed, _rec)


def _guarded(hook: Any) -> Any:
    """A hook whose own failure is one line on stderr, not the training's exception. One
    wrapper per arity: no argument tuple is built on the hot path."""
    name = hook.__name__
    n = hook.__code__.co_argcount

    def fail(e: Exception) -> None:
        _hook_failed(name, e)

    if n == 1:
        def guarded(a: Any) -> Any:
            try:
                return hook(a)
            except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
                fail(e)
    elif n == 2:
        def guarded(a: Any, b: Any) -> Any:  # type: ignore[misc]
            try:
                return hook(a, b)
            except Exception as e:  # noqa: BLE001
                fail(e)
    elif n == 3:
        def guarded(a: Any, b: Any, c: Any) -> Any:  # type: ignore[misc]
            try:
                return hook(a, b, c)
            except Exception as e:  # noqa: BLE001
                fail(e)
    elif n == 4:
        def guarded(a: Any, b: Any, c: Any, d: Any) -> Any:  # type: ignore[misc]
            try:
                return hook(a, b, c, d)
            except Exception as e:  # noqa: BLE001
                fail(e)
    else:
        def guarded(*args: Any) -> Any:  # type: ignore[misc]
            try:
                return hook(*args)
            except Exception as e:  # noqa: BLE001
                fail(e)
    return functools.wraps(hook)(guarded)
