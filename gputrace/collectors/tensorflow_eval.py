"""Evaluation in a TensorFlow custom loop (outside Keras' `fit`), from what TensorFlow shows:
a Keras model called with no gradient tape that could record it (TensorFlow's own
`could_possibly_record`: the analogue of PyTorch's `no_grad`) is a forward pass that trains
nothing. Such a call, eagerly (`model(x, training=False)`) or in a `tf.function` that ran
one while being traced and never applied gradients (a compiled evaluation step, Keras'
`evaluate`), once the loop has taken a training step, is an evaluation batch (an
`evaluation` span `batch`); the batches in a row, with the loop's batch requests and the
other work between them, are one pass (`evaluation` `pass`): from the validation data's
iterator made (or its first batch requested) after the last training step, to the loop's
next batch request after its last batch (the one that opens the next training iteration),
or the next training work, or a Keras save's start: the validation iterator's end and
deletion (tens to hundreds of ms on a busy CPU, after the request that found it empty) are
the pass's. The training iteration opened at the last step's end, where no training work
ran in it since, is dropped there; the next opens at that request. Before the first
training step such calls stay where they are (a model called once to build its weights is
common there).

Training work, which ends a pass: a gradient tape entered eagerly, a call of a `tf.function`
that applied gradients, an eager optimizer step."""

from __future__ import annotations

import functools
import threading
from typing import Any

_tls = threading.local()


class Passes:
    """The evaluation pass in progress in a custom loop (one per collectors.tensorflow
    _State, its `passes`; the hooks there call these, each failure of ours one line)."""

    def __init__(self, s: Any) -> None:
        self.s = s
        self.train_t = -1            # the last training work's start
        self.from_t: int | None = None   # the pass in progress: its start
        self.last = 0                # ... its last batch's end (or its iterator's end)
        self.batches = 0
        self.req: int | None = None  # a batch request after the pass's last batch
        self.first_req: int | None = None   # the first batch request since training work
        self.made: int | None = None         # ... the first iterator made since then

    def training(self, t: int) -> None:
        """Training work begins at t: a pass in progress ends, and the iteration opens at
        the first batch request after it (or at t)."""
        self.train_t = t
        self.first_req = self.made = None
        if self.from_t is None:
            return
        at = self.req if self.req is not None else t
        self.last = max(self.last, at)
        self.close()
        if self.s.open_t is None:
            self.s.begin(at)

    def requested(self, t: int) -> bool:
        """A batch request (or a call of a function not known to train) at t: True where a
        pass is in progress (no iteration opens)."""
        if self.from_t is not None:
            if self.req is None:
                self.req = t
            return True
        if self.first_req is None:
            self.first_req = t
        return False

    def iterator_made(self, t: int) -> None:
        if self.from_t is None and self.made is None:
            self.made = t

    def exhausted(self, t: int) -> None:
        """A batch request found its iterator empty at t: the pass's data ends there (the
        next request is the next iteration's)."""
        if self.from_t is not None and self.req is not None:
            self.last, self.req = t, None

    def aside(self, t: int) -> None:
        """Something that is no evaluation begins at t (a save): a pass ends there."""
        if self.from_t is not None:
            self.last = max(self.last, t)
            self.close()

    def batch(self, t0: int, t1: int) -> None:
        """A forward-only call ran from t0 to t1: an evaluation batch, where the loop has
        taken a training step and the open iteration holds no training work."""
        s = self.s
        if s.k == 0 or s.in_fit:
            return
        if s.open_t is not None:
            if self.train_t >= s.open_t:
                return          # inside a step's work: it stays there
            lo = s.open_t
            s.open_t = None     # the iteration opened at the last step's end: none
            if self.from_t is None:
                seen = [x for x in (self.made, self.first_req) if x is not None and x >= lo]
                self.from_t = min(seen, default=t0)
        if self.from_t is None:
            self.from_t = t0
        self.batches += 1
        self.last, self.req = max(self.last, t1), None
        s.rec.span("evaluation", "batch", t0, t1, step=-1)

    def close(self) -> None:
        if self.from_t is None:
            return
        self.s.rec.span("evaluation", "pass", self.from_t, max(self.last, self.from_t),
                        step=-1, args={"batches": self.batches})
        self.from_t, self.batches, self.last, self.req = None, 0, 0, None


def passes(s: Any) -> Passes:
    if s.passes is None:
        s.passes = Passes(s)
    return s.passes


def forward_only() -> bool:
    """No gradient tape could record what runs now (eagerly, or in a function's trace)."""
    from tensorflow.python.eager import record

    return not record.could_possibly_record()


def patch_models(state: Any, keras: Any, fail: Any) -> None:
    """Keras models' calls (the outermost on a thread): forward-only ones noted. Only on
    TensorFlow's backend (on torch's, its own hooks tell evaluation apart). `fail(where,
    e)`: a failure of ours, one line; the model's call goes on."""
    model = getattr(keras, "Model", None)
    backend = getattr(getattr(keras, "backend", None), "backend", None)
    if not isinstance(model, type) or backend is None or backend() != "tensorflow":
        return
    orig = next((c.__dict__["__call__"] for c in model.__mro__ if "__call__" in c.__dict__),
                None)
    if orig is None or getattr(orig, "_gputrace", False):
        return
    import tensorflow as tf

    executing_eagerly = tf.executing_eagerly

    @functools.wraps(orig)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_tls, "depth", 0) or state.in_fit or not state.tf_ops:
            return orig(self, *args, **kwargs)
        try:
            t0 = _model_call(state, executing_eagerly())
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            fail("Model.__call__", e)
            t0 = 0
        _tls.depth = 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            _tls.depth = 0
            if t0:
                try:
                    passes(state).batch(t0, state.now())
                except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
                    fail("Model.__call__", e)

    __call__._gputrace = True  # type: ignore[attr-defined]
    model.__call__ = __call__


def _model_call(s: Any, eager: bool) -> int:
    """The start of an eager forward-only call (0 otherwise); traced into the function the
    loop is calling, that function noted as running one."""
    if not forward_only():
        return 0
    if eager:
        return int(s.now())
    if s.calling is not None:
        s.calling._gputrace_forward = True
    return 0


def function_returned(s: Any, fn: Any, t0: int, t1: int) -> None:
    """The loop's call of a tf.function returned: one that ran a forward-only model call and
    applied no gradients is an evaluation step from now on, this call a batch."""
    if getattr(fn, "_gputrace_step", False):
        return
    if getattr(fn, "_gputrace_forward", False):
        fn._gputrace_eval = True
        passes(s).batch(t0, t1)
