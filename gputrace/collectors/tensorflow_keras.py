"""Keras's `Model.fit`, recorded: a callback gputrace adds to every fit gives the iterations
(one from a batch's begin to the next one's; with `steps_per_execution` k, a call's time split
evenly among its k steps) and each validation pass (`validation_data`) as an `evaluation`
span; a save inside fit (`ModelCheckpoint`: collectors.tensorflow_saves) ends the open step;
the job's own callbacks run as before."""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from gputrace.collectors import tensorflow_state as core
from gputrace.collectors.tensorflow_state import _safe, _State
from gputrace.recorder.core import Recorder


def _callback_class(keras: Any) -> Any:
    class GputraceSteps(keras.callbacks.Callback):
        """gputrace's iteration boundaries (added to every fit by gputrace record)."""

        # its batch end only notes a time, so fit keeps dispatching batch ends to a thread
        # when the job's own callbacks let it (one that is not async-safe would stop that)
        async_safe = True

        def __init__(self, state: _State) -> None:
            super().__init__()
            self._s = state
            self._open = False
            self._end = 0               # the latest batch end (on Keras's thread when async)
            self._graph = True
            self._wrapped: tuple[Any, Any, Any] | None = None
            self._eval: list[int] = []      # a validation pass's start and its batches

        def _steps(self) -> int:
            spe = getattr(getattr(self, "model", None), "steps_per_execution", 1)
            try:
                return max(int(spe), 1)
            except (TypeError, ValueError):
                return 1

        @_safe
        def on_train_begin(self, logs: Any = None) -> None:
            model = getattr(self, "model", None)
            eager = bool(getattr(model, "run_eagerly", False))
            backend = keras.backend.backend()
            # phases from the profiler on TensorFlow; on torch, its own hooks time them
            self._graph = backend == "tensorflow" and not eager
            self._s.tf_ops = backend == "tensorflow"
            self._s.in_fit += 1
            self._s.fit_aside = self.aside
            _quiet_torch_iterations(self._s.rec, True)
            if self._graph:
                self._wrapped = _time_step_function(self._s, model)

        @_safe
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            s = self._s
            t = s.now()
            if self._open:
                s.framework_until(t)
                s.end_step(t, self._graph, self._steps())   # iterations tile the loop
            else:
                s.begin(t)
                self._open = True
            # from the iteration's start (after the profiler's start or stop, when one
            # happened at this boundary): Keras's own work, until its step function runs
            s.fw_from = s.open_t if self._graph else None

        @_safe
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._end = max(self._end, self._s.now())

        def _last(self) -> None:
            """The epoch's last step ends at its batch end (fit has waited for every batch
            end by now)."""
            s = self._s
            if self._open:
                start = s.open_t if s.open_t is not None else 0
                end = self._end if self._end > start else s.now()
                s.framework_until(end)
                s.end_step(end, self._graph, self._steps(), reopen=False)
            s.fw_from = None
            self._open = False
            s.open_t = None

        def aside(self, t: int) -> None:
            """A save at t (ModelCheckpoint's, at a batch's end or the epoch's): the open
            step ends there, the next begins at the next batch's begin."""
            s = self._s
            if self._open:
                s.framework_until(t)
                s.end_step(t, self._graph, self._steps(), reopen=False)
                self._open = False
                s.open_t = None
            s.fw_from = None

        @_safe
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self._last()

        # fit's validation (validation_data) runs its evaluate with fit's callbacks, after
        # the epoch's last batch: an evaluation pass, no training step's time
        @_safe
        def on_test_begin(self, logs: Any = None) -> None:
            if self._s.in_fit:
                self._last()
                self._eval = [self._s.now(), 0]

        @_safe
        def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
            if self._eval:
                self._eval[1] += 1

        @_safe
        def on_test_end(self, logs: Any = None) -> None:
            if self._eval:
                t0, n = self._eval
                self._eval = []
                self._s.rec.span("evaluation", "pass", t0, self._s.now(), step=-1,
                                 args={"batches": n, "framework": "keras"})

        @_safe
        def on_train_end(self, logs: Any = None) -> None:
            self._last()
            s = self._s
            s.in_fit = max(s.in_fit - 1, 0)
            s.fit_aside = None
            _unwrap_step_function(self._wrapped)
            self._wrapped = None
            s.tf_ops = True
            if s.window is not None and s.window[1] < 0 and s.profiling:
                s.stop_profiler()    # `all`: the whole fit
            _quiet_torch_iterations(s.rec, False)

    return GputraceSteps


def _time_step_function(state: _State, model: Any) -> tuple[Any, Any, Any] | None:
    """Time the step function fit calls once per step (`model.train_function`, made before
    the callbacks' train begin): what Keras does in an iteration outside it (its loop, the
    logs, the callbacks) is its own per-step work, recorded as `framework` spans. Returns
    what to put back at train end."""
    fn = getattr(model, "train_function", None)
    if not callable(fn) or getattr(fn, "_gputrace", False):
        return None
    now = state.now

    @functools.wraps(fn)
    def train_function(*args: Any, **kwargs: Any) -> Any:
        _step_called(state, now())
        try:
            return fn(*args, **kwargs)
        finally:
            state.fw_from = now()       # Keras's own work again, until the next call

    train_function._gputrace = True  # type: ignore[attr-defined]
    model.train_function = train_function
    return model, fn, train_function


@_safe
def _step_called(state: _State, t: int) -> None:
    state.framework_until(t)


@_safe
def _unwrap_step_function(wrapped: tuple[Any, Any, Any] | None) -> None:
    if wrapped is not None and getattr(wrapped[0], "train_function", None) is wrapped[2]:
        wrapped[0].train_function = wrapped[1]


def _quiet_torch_iterations(rec: Recorder, quiet: bool) -> None:
    """While fit's callback gives the iterations, gputrace's torch hooks (Keras on the torch
    backend) keep timing phases but leave the iterations alone."""
    mod = sys.modules.get("gputrace.collectors.torch")
    st = getattr(mod, "_installed", None) if mod is not None else None
    if st is None:
        return
    if quiet and not isinstance(st.its, _NoIterations):
        st._gputrace_its = st.its
        st.its = _NoIterations()
    elif not quiet and hasattr(st, "_gputrace_its"):
        st.its = st.__dict__.pop("_gputrace_its")
    rec.drop_iteration()


class _NoIterations:
    last_bwd = 0
    fw_pass = False

    def batch(self, t: int) -> None: ...
    def exhausted(self, t0: int = 0, t: int = 0) -> None: ...
    def aside(self, t: int, loader: bool = False) -> None: ...
    def framework_pass(self, begin: bool, t: int) -> int: return 0
    def end_pass(self) -> None: ...
    def forward(self, t: int, grad: bool) -> None: ...
    def backward(self) -> None: ...
    def stepped(self, t: int) -> None: ...
    def finish(self, t: int) -> None: ...


def patch_fit(state: _State, keras: Any) -> None:
    model_cls = keras.Model
    if getattr(model_cls.fit, "_gputrace", False):
        return
    orig_fit = model_cls.fit
    sig = inspect.signature(orig_fit)
    cb_cls = _callback_class(keras)

    @functools.wraps(orig_fit)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        joined = None       # the job's own CallbackList, which ours joins for this fit
        try:
            bound = sig.bind(self, *args, **kwargs)
            cbs = bound.arguments.get("callbacks")
            mine = cb_cls(state)
            if cbs is None:
                cbs = [mine]
            elif isinstance(cbs, list | tuple):
                cbs = [*cbs, mine]
            elif isinstance(cbs, keras.callbacks.CallbackList):
                # fit uses it as it is; async-safe, ours leaves its dispatch as it was
                mine.set_model(self)
                cbs.callbacks.append(mine)
                joined = cbs
            else:       # another container: leave it as it is
                raise TypeError(f"callbacks given as {type(cbs).__name__}")
            bound.arguments["callbacks"] = cbs
            args, kwargs = bound.args[1:], bound.kwargs
        except Exception as e:  # noqa: BLE001 - fit runs as the job wrote it
            core._fail("Model.fit", e)
        try:
            return orig_fit(self, *args, **kwargs)
        finally:
            if joined is not None:
                _leave(joined.callbacks, mine)

    fit._gputrace = True  # type: ignore[attr-defined]
    model_cls.fit = fit


@_safe
def _leave(callbacks: list[Any], mine: Any) -> None:
    """The job's CallbackList as it was before fit."""
    callbacks.remove(mine)
