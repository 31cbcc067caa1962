"""Keras's optimizers, timed. Every optimizer Keras ships goes through one method of a base
class: `apply` in Keras 3 (through `keras` or `tf.keras`; `apply_gradients` calls it), and
`apply_gradients` in tf_keras (Keras 2: its optimizers and its legacy ones). That method is
wrapped once per base: an eager call is the update phase (in a custom loop also the
iteration's end); a call traced into a `tf.function` marks that function as a training step,
whose return then ends the iteration."""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from gputrace.collectors import tensorflow_state as core
from gputrace.collectors.tensorflow_state import _safe, _State


def _bases(keras: Any) -> list[tuple[type, str]]:
    """(class, method) to wrap: the first class of each optimizer base's MRO that defines
    `apply`, else `apply_gradients`."""
    opts = getattr(keras, "optimizers", None)
    found: list[tuple[type, str]] = []
    legacy = None
    try:
        legacy = getattr(getattr(opts, "legacy", None), "Optimizer", None)
    except Exception:  # noqa: BLE001 - a lazily loaded module that does not load
        legacy = None
    for cls in (getattr(opts, "Optimizer", None), legacy):
        if not isinstance(cls, type):
            continue
        for name in ("apply", "apply_gradients"):
            owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
            if owner is not None:
                if (owner, name) not in found:
                    found.append((owner, name))
                break
    return found


def patch_optimizers(state: _State, keras: Any) -> None:
    if not _bases(keras):
        raise TypeError(f"{getattr(keras, '__name__', keras)}.optimizers has no Optimizer "
                        "with apply or apply_gradients")
    now = state.now
    for owner, name in _bases(keras):
        orig = owner.__dict__[name]
        if getattr(orig, "_gputrace", False):
            continue
        setattr(owner, name, _timed(orig, now))


def _timed(orig: Any, now: Any) -> Any:
    @functools.wraps(orig)
    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_tls, "depth", 0)
        if depth:               # an optimizer calling another (a wrapper's inner one)
            return orig(self, *args, **kwargs)
        t0 = now()
        how = _before_apply(self)
        _tls.depth = 1
        try:
            out = orig(self, *args, **kwargs)
        finally:
            _tls.depth = 0
        if how:
            _after_apply(self, t0, how == "step")
        return out

    apply._gputrace = True  # type: ignore[attr-defined]
    return apply


_tls = threading.local()


@_safe
def _before_apply(opt: Any) -> str | None:
    """How to time this optimizer call: "step" (an eager TensorFlow loop: the update, and
    the iteration's end), "update" (eager, inside fit or on another backend: the update
    only) or None (traced into a tf.function, which it marks as a training step)."""
    s = core._state
    if s is None:
        return None
    name = getattr(opt, "name", None)
    if isinstance(name, str) and name not in s.optimizers:
        s.optimizers.add(name)
    keras = sys.modules.get("keras")
    backend = keras.backend.backend() if keras is not None else "tensorflow"
    if backend != "tensorflow":
        return "update" if s.in_fit else None   # outside fit, torch's own hooks
    tf = sys.modules.get("tensorflow")
    if tf is not None and not tf.executing_eagerly():
        # traced into the function the loop is calling (maybe on a replica's thread)
        if s.calling is not None:
            s.calling._gputrace_step = True
        return None
    return "update" if s.in_fit else "step"


@_safe
def _after_apply(opt: Any, t0: int, step: bool) -> None:
    s = core._state
    assert s is not None
    t = s.now()
    if step:
        from gputrace.collectors.tensorflow_eval import passes

        passes(s).training(t0)
        s.begin(t0)
    s.rec.span("update", type(opt).__name__, t0, t)
    if step:
        s.end_step(t, graph=False)
