"""Keras's saves on the recorder: `Model.save` and `Model.save_weights` (what Keras's
`ModelCheckpoint` calls, and a job's own calls), each a `checkpoint` span as torch.save's
(step -1, `args.op` `save`), named `keras.save` or `keras.save_weights`, its `bytes` those of
the files it wrote or rewrote at its path (a `.keras` or `.h5` file, or a SavedModel's
folder). Only the outermost call is recorded. Inside `fit`, the open training step ends
where the save begins (a `ModelCheckpoint` saving at a batch's end or at the epoch's)."""

from __future__ import annotations

import functools
import threading
from typing import Any

from gputrace.collectors import tensorflow_state as core
from gputrace.collectors.files import files_at
from gputrace.collectors.tensorflow_state import _safe, _State

_depth = threading.local()


def _path_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("filepath")


@_safe
def _begin(state: _State, args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> tuple[int, dict[str, tuple[int, int]]]:
    t0 = state.now()
    if state.fit_aside is not None:
        state.fit_aside(t0)
    if state.passes is not None:
        state.passes.aside(t0)      # a custom loop's evaluation pass ends where it begins
    return t0, files_at(_path_of(args, kwargs))


@_safe
def _end(state: _State, name: str, t0: int, before: dict[str, tuple[int, int]],
         args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    t1 = state.now()
    after = files_at(_path_of(args, kwargs))
    nbytes = sum(size for p, (size, mt) in after.items()
                 if before.get(p) != (size, mt)) if after else None
    state.rec.span("checkpoint", name, t0, t1, step=-1, nbytes=nbytes, args={"op": "save"})


def _wrap(state: _State, name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def save(*args: Any, **kwargs: Any) -> Any:
        if getattr(_depth, "n", 0):
            return fn(*args, **kwargs)
        got = _begin(state, args, kwargs)
        _depth.n = 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _depth.n = 0
        if got is not None:
            _end(state, name, got[0], got[1], args, kwargs)
        return out

    save._gputrace = True  # type: ignore[attr-defined]
    return save


def patch_saves(state: _State, keras: Any) -> None:
    cls = keras.Model
    for meth in ("save", "save_weights"):
        fn = getattr(cls, meth, None)
        if fn is None or getattr(fn, "_gputrace", False):
            continue
        try:
            setattr(cls, meth, _wrap(state, f"keras.{meth}", fn))
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            core._fail(f"Model.{meth}", e)
