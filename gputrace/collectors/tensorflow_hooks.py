"""TensorFlow's custom loops, recorded: GradientTape (forward until `gradient`, backward in
it), tf.data iterators (the loop's wait for a batch), `tf.function` calls (a compiled
training step ends the iteration when it returns), the profiler (the job's own start ends
gputrace's window) and the collectives' bytes, as they are traced."""

from __future__ import annotations

import functools
import sys
from typing import Any

from gputrace.collectors import tensorflow_state as core
from gputrace.collectors.tensorflow_eval import function_returned, passes
from gputrace.collectors.tensorflow_state import _safe, _State


def patch_tensorflow(state: _State, tf: Any) -> None:
    from tensorflow.python.data.ops import iterator_ops
    from tensorflow.python.eager import backprop
    from tensorflow.python.eager.polymorphic_function import polymorphic_function as pf

    now = state.now
    rec = state.rec
    tape_cls = backprop.GradientTape
    if getattr(tape_cls.__enter__, "_gputrace", False):
        return
    orig_enter, orig_gradient = tape_cls.__enter__, tape_cls.gradient
    orig_next = iterator_ops.OwnedIterator.__next__
    orig_init = iterator_ops.OwnedIterator.__init__
    orig_call = pf.Function.__call__
    executing_eagerly = tf.executing_eagerly

    def loop_eager() -> bool:
        return not state.in_fit and executing_eagerly()

    @functools.wraps(orig_enter)
    def __enter__(self: Any) -> Any:
        if loop_eager():
            _tape_entered(now())
        return orig_enter(self)

    @functools.wraps(orig_gradient)
    def gradient(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not loop_eager():
            return orig_gradient(self, *args, **kwargs)
        t0 = now()
        try:
            return orig_gradient(self, *args, **kwargs)
        finally:
            _gradient_done(t0, now())

    @functools.wraps(orig_next)
    def __next__(self: Any) -> Any:
        if not loop_eager():
            return orig_next(self)
        t0 = now()
        _batch_requested(t0)
        try:
            out = orig_next(self)
        except StopIteration:
            _exhausted(now())
            raise
        rec.span("io", "tf.data", t0, now())
        return out

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if loop_eager():
            _iterator_made(now())
        orig_init(self, *args, **kwargs)

    tls = state.tls

    @functools.wraps(orig_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        stack = getattr(tls, "functions", None)
        if stack is None:
            stack = tls.functions = []
        outer = not stack and not state.in_fit
        t0 = now() if outer else 0
        if outer:
            # a training step begins training work; an evaluation step is no batch request
            if getattr(self, "_gputrace_step", False):
                _training(t0)
            if not getattr(self, "_gputrace_eval", False):
                _batch_requested(t0)
        stack.append(self)
        if outer:
            state.calling = self
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            stack.pop()
            if outer:
                state.calling = None
                if getattr(self, "_gputrace_step", False):
                    _training(t0)       # (a first call, traced: known a step only now)
                    _step_returned(now())
                else:
                    _function_returned(self, t0, now())

    for fn in (__enter__, gradient, __next__, __call__, __init__):
        fn._gputrace = True  # type: ignore[attr-defined]
    tape_cls.__enter__ = __enter__
    tape_cls.gradient = gradient
    iterator_ops.OwnedIterator.__next__ = __next__
    iterator_ops.OwnedIterator.__init__ = __init__
    pf.Function.__call__ = __call__


def patch_collectives(state: _State) -> None:
    """The bytes of each all-reduce, as its op is traced into a function (the profiler of
    a CPU run gives none): the size of the tensor it reduces (a pack of gradients)."""
    from tensorflow.python.ops import collective_ops

    orig = collective_ops.all_reduce_v2
    if getattr(orig, "_gputrace", False):
        return

    @functools.wraps(orig)
    def all_reduce_v2(t: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(t, *args, **kwargs)
        _collective_traced(t, out)
        return out

    all_reduce_v2._gputrace = True  # type: ignore[attr-defined]
    collective_ops.all_reduce_v2 = all_reduce_v2


@_safe
def _collective_traced(t: Any, out: Any) -> None:
    s = core._state
    if s is None:
        return
    try:
        name = out.op.name          # eager tensors have no op: nothing to name in a profile
    except AttributeError:
        return
    n = t.shape.num_elements()
    if n is not None:
        s.comm_bytes[name] = int(n) * t.dtype.size


def patch_profiler(state: _State) -> None:
    """TensorFlow runs one profiler at a time: when the job starts its own (its code, a
    TensorBoard callback) while gputrace's window is open, the window ends there and the
    job's profiler starts as it would without gputrace."""
    from tensorflow.python.profiler import profiler_v2

    orig = profiler_v2.start
    if getattr(orig, "_gputrace", False):
        return
    state.tf_start = orig

    @functools.wraps(orig)
    def start(*args: Any, **kwargs: Any) -> Any:
        _yield_profiler()
        return orig(*args, **kwargs)

    start._gputrace = True  # type: ignore[attr-defined]
    profiler_v2.start = start       # what profiler_v2.Profile calls
    for name, mod in list(sys.modules.items()):     # tf.profiler.experimental and its aliases
        if name.startswith("tensorflow") and name.endswith("profiler.experimental") and \
                getattr(mod, "start", None) is orig:
            mod.start = start


@_safe
def _yield_profiler() -> None:
    s = core._state
    if s is None or not s.profiling:
        return
    from gputrace.fmt import count

    note = (f"the job started TensorFlow's profiler itself in step {s.k}: gputrace's window "
            f"ends there, with phases for {count(s.profiled_steps, 'step')}")
    s.notes.append(note)
    print(f"gputrace: {note}", file=sys.stderr)
    s.stop_profiler()


@_safe
def _tape_entered(t: int) -> None:
    s = core._state
    assert s is not None
    passes(s).training(t)
    s.begin(t)
    if s.tape_t is None:
        s.tape_t = t


@_safe
def _gradient_done(t0: int, t1: int) -> None:
    s = core._state
    assert s is not None
    if s.tape_t is not None:
        # what ran under the tape (model and loss), until its gradient was asked for
        s.rec.span("forward", "GradientTape", s.tape_t, t0)
        s.tape_t = None
    s.rec.span("backward", "GradientTape.gradient", t0, t1)


@_safe
def _batch_requested(t: int) -> None:
    s = core._state
    assert s is not None
    if not passes(s).requested(t):      # inside an evaluation pass no iteration opens
        s.begin(t)


@_safe
def _function_returned(fn: Any, t0: int, t1: int) -> None:
    s = core._state
    assert s is not None
    function_returned(s, fn, t0, t1)


@_safe
def _training(t: int) -> None:
    s = core._state
    assert s is not None
    passes(s).training(t)


@_safe
def _exhausted(t: int) -> None:
    s = core._state
    assert s is not None
    passes(s).exhausted(t)


@_safe
def _iterator_made(t: int) -> None:
    s = core._state
    assert s is not None
    passes(s).iterator_made(t)


@_safe
def _step_returned(t: int) -> None:
    s = core._state
    assert s is not None
    s.end_step(t, graph=True)
