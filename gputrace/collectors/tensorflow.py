"""TensorFlow and Keras auto-instrumentation: iterations from the training loop, phases from
TensorFlow's own profiler over a window of steps.

Installed by the `record` bootstrap right after the job imports tensorflow or keras (never
before: a job that does not use them pays nothing). Iterations:

- Keras `Model.fit`: a callback gputrace adds to every `fit` (the job's own callbacks run as
  before). An iteration runs from one batch's begin to the next one's (the callbacks' work
  between two steps belongs to one); with `steps_per_execution` k, one call runs k steps and
  its time is divided evenly among them;
- custom loops: an iteration ends when the optimizer's `apply_gradients` (`apply`) returns
  (eagerly),
  or when a `tf.function` that applied gradients returns (a compiled training step); the next
  begins there. The first begins at the loop's first batch request, tape or step.

Phases: TensorFlow's profiler (`tf.profiler.experimental`) runs over a window of steps
(`GPUTRACE_TF_STEPS`: `START:COUNT`, default `5:10`; `all` from the first step to the end;
`off`; in a multi-worker job, TF_CONFIG naming more than one task, only a window asked for:
TensorFlow's profiler can kill a worker there), and its ops are converted by
`gputrace.importers.tfprof`: a compiled step's ops by their names (forward, `gradient_tape/` = backward, the optimizer's scope = update,
collectives = comm, the input pipeline's wait = io on the loop's thread, tf.data's own work
= io on its threads). The profiler's start and stop fall between two iterations, outside
both. In an eager loop the hooks time the phases themselves, every step: `io` (the wait in
a tf.data iterator's `__next__`), `forward` (from entering the GradientTape to
`tape.gradient`), `backward` (`tape.gradient`), `update` (`apply_gradients`). A compiled step
outside the window is a `user` span `step (not profiled)`: its phases are not known, and
the analysis holds only iterations whose phases are; where no step is profiled (`off`, a
multi-worker job by default) every step is an iteration, its time in no phase.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from gputrace.collectors import tensorflow_state as core
from gputrace.collectors.process import install_run_span
from gputrace.collectors.tensorflow_state import _fail, _refresh_rank, _State
from gputrace.recorder.core import Recorder


def _state_for(rec: Recorder) -> _State:
    s = core._state
    if s is None or s.rec is not rec:
        s = core._state = _State(rec, os.environ.get("GPUTRACE_TF_STEPS"))
        rec.close_hooks.append(s.finish)
        install_run_span(rec)       # the whole run's clock (goodput)
        s._status()
    return s


def on_tensorflow(rec: Recorder, tf: Any) -> str:
    """Hooks for custom loops (tapes, tf.data iterators, tf.function steps)."""
    _refresh_rank(rec)
    state = _state_for(rec)
    from gputrace.collectors import tensorflow_hooks as hooks

    hooks.patch_tensorflow(state, tf)
    # before TensorFlow's own exit handlers (registered at its import, so run after ours)
    atexit.register(state.stop_profiler)
    rec.metadata.setdefault("software", {})["tensorflow"] = getattr(tf, "__version__", "?")
    for patch in (hooks.patch_profiler, hooks.patch_collectives):     # refinements: the rest goes on
        try:
            patch(state)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _fail(patch.__name__, e)
    return "ok"


def on_keras(rec: Recorder, keras: Any) -> str:
    """The fit callback and the optimizers (Keras 3 as `keras` or `tf.keras`, or tf_keras)."""
    state = _state_for(rec)
    from gputrace.collectors.tensorflow_keras import patch_fit
    from gputrace.collectors.tensorflow_keras_data import patch_epoch_iterator
    from gputrace.collectors.tensorflow_optimizers import patch_optimizers
    from gputrace.collectors.tensorflow_saves import patch_saves

    patch_fit(state, keras)
    patch_epoch_iterator(state)
    patch_saves(state, keras)
    patch_optimizers(state, keras)
    try:
        from gputrace.collectors.tensorflow_eval import patch_models

        patch_models(state, keras, _fail)   # a custom loop's evaluation: a refinement
    except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
        _fail("patch_models", e)
    rec.metadata.setdefault("software", {})["keras"] = getattr(keras, "__version__", "?")
    return "ok"
