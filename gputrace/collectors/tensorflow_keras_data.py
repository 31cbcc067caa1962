"""What Keras's `fit` does between its training steps at an epoch's end, recorded: its input
pipeline (building `validation_data`'s pipeline, its `TFEpochIterator` made at the first
validation, and each epoch's first batch: the dataset's iterator made anew and its first
batch read, before the epoch's first step begins), each a `loader` span on the loop's
thread, so the whole run's data stalls; and its validation's `evaluate` call, a `framework`
span around the evaluation pass (its set-up before the pass's first callback and its return
after the last: the run's `other`). Within an epoch a batch is read in the step before it.
Keras 3 on TensorFlow only (its trainer module already imported by `import keras`); another
Keras leaves those gaps as they were (stalls)."""

from __future__ import annotations

import functools
import sys
from typing import Any

from gputrace.collectors.tensorflow_state import _safe, _State

TRAINER = "keras.src.backend.tensorflow.trainer"
BUILT = "keras: input pipeline built"           # a TFEpochIterator made inside fit
FIRST = "keras: epoch's first batch"            # its iterator made anew, the first batch read
EVALUATE = "keras: evaluate (validation)"       # fit's validation call, around its pass


@_safe
def patch_epoch_iterator(state: _State) -> None:
    mod = sys.modules.get(TRAINER)
    cls = getattr(mod, "TFEpochIterator", None)
    if cls is None or getattr(cls.__next__, "_gputrace", False):
        return
    orig_init, orig_iter, orig_next = cls.__init__, cls.__iter__, cls.__next__

    @_safe
    def note(name: str, t0: int) -> None:
        state.rec.span("loader", name, t0, state.now(), step=-1)

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        t0 = state.now() if state.in_fit else 0
        orig_init(self, *args, **kwargs)
        if t0:
            note(BUILT, t0)

    @functools.wraps(orig_iter)
    def __iter__(self: Any) -> Any:
        out = orig_iter(self)
        self._gputrace_first = True      # the next batch is the epoch's first
        return out

    @functools.wraps(orig_next)
    def __next__(self: Any) -> Any:
        if not (state.in_fit and getattr(self, "_gputrace_first", False)):
            return orig_next(self)
        self._gputrace_first = False
        t0 = state.now()
        try:
            return orig_next(self)
        finally:
            note(FIRST, t0)

    __next__._gputrace = True  # type: ignore[attr-defined]
    cls.__init__, cls.__iter__, cls.__next__ = __init__, __iter__, __next__
    trainer = getattr(mod, "TensorFlowTrainer", None)
    if trainer is not None:
        _patch_evaluate(state, trainer)


def _patch_evaluate(state: _State, trainer: Any) -> None:
    orig = trainer.evaluate

    @_safe
    def note(t0: int) -> None:
        state.rec.span("framework", EVALUATE, t0, state.now(), step=-1)

    @functools.wraps(orig)
    def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = state.now() if state.in_fit else 0
        try:
            return orig(self, *args, **kwargs)
        finally:
            if t0:
                note(t0)

    trainer.evaluate = evaluate
