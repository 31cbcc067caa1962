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
`off`), and its ops are converted by `gputrace.importers.tfprof`: a compiled step's ops by
their names (forward, `gradient_tape/` = backward, the optimizer's scope = update,
collectives = comm, the input pipeline's wait = io on the loop's thread, tf.data's own work
= io on its threads). The profiler's start and stop fall between two iterations, outside
both. In an eager loop the hooks time the phases themselves, every step: `io` (the wait in
a tf.data iterator's `__next__`), `forward` (from entering the GradientTape to
`tape.gradient`), `backward` (`tape.gradient`), `update` (`apply_gradients`). A compiled step
outside the window is a `user` span `step (not profiled)`: its phases are not known, and
the analysis holds only iterations whose phases are.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

from gputrace.collectors import instrumentation_failed
from gputrace.recorder import Recorder

_state: _State | None = None
_failed: list[str] = []
DEFAULT_WINDOW = (5, 10)


def _fail(where: str, e: BaseException) -> None:
    instrumentation_failed("tensorflow", "TensorFlow", where, e, _failed,
                           _state.rec if _state is not None else None)


def _safe(fn: Any) -> Any:
    """A hook of ours whose failure is one line on stderr, never the job's exception."""
    @functools.wraps(fn)
    def safe(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _fail(fn.__name__, e)
            return None
    return safe


def window_from_env(value: str | None) -> tuple[int, int] | None:
    """`START:COUNT`, `all` (0 and unbounded) or `off` (None)."""
    if value is None or value == "":
        return DEFAULT_WINDOW
    if value == "off":
        return None
    if value == "all":
        return (0, -1)
    try:
        a, b = value.split(":")
        start, count = int(a), int(b)
        if start < 0 or count < 1:
            raise ValueError
        return start, count
    except ValueError:
        print(f"gputrace: GPUTRACE_TF_STEPS={value!r} is not START:COUNT, all or off; "
              f"using {DEFAULT_WINDOW[0]}:{DEFAULT_WINDOW[1]}", file=sys.stderr)
        return DEFAULT_WINDOW


class _State:
    def __init__(self, rec: Recorder, window: tuple[int, int] | None) -> None:
        self.rec = rec
        self.now = rec.clock.now_ns
        self.window = window
        self.k = 0                          # the next step's index
        self.open_t: int | None = None      # start of the open iteration
        self.graph = False                  # its phases come from the profiler
        self.profiling = False
        self.logdir: str | None = None
        self.windows: list[tuple[int, int]] = []   # iterations written while profiling
        self.profiled_steps = 0
        self.optimizers: set[str] = set()
        self.in_fit = 0
        self.tf_ops = True                  # the loop runs TensorFlow ops (not Keras on torch)
        self.tape_t: int | None = None      # an eager tape was entered
        self.loop_tid: int | None = None
        self.lock = threading.RLock()
        self.tls = threading.local()
        self.calling: Any = None            # the tf.function the loop is calling
        self.notes: list[str] = []
        self.converted: dict[str, int] = {}
        self.tf_start: Any = None           # TensorFlow's own profiler start (unwrapped)
        self.comm_bytes: dict[str, int] = {}    # all-reduce op (graph name) -> its bytes

    # -- iterations ----------------------------------------------------------------------
    def begin(self, t: int) -> None:
        if self.open_t is None:
            if self.k == 0 and self.window == (0, -1) and self.tf_ops and \
                    not self.profiling and self.start_profiler():
                t = self.now()      # `all`: from the first step, its start left out
            self.open_t = t
            self.rec.step = self.k

    def end_step(self, t: int, graph: bool, n: int = 1, reopen: bool = True) -> None:
        """The open iteration ends at t (n steps, split evenly); window control; the next
        begins at t (or after the profiler's start or stop)."""
        with self.lock:
            start = self.open_t if self.open_t is not None else t
            self.open_t = None
            from gputrace.recorder import _native_tid

            if self.k == 0:
                _refresh_rank(self.rec)
            self.loop_tid = _native_tid()
            for j in range(n):
                s = start + (t - start) * j // n
                e = start + (t - start) * (j + 1) // n
                if graph and not self.profiling:
                    self.rec.span("user", "step (not profiled)", s, e, step=self.k)
                else:
                    self.rec.span("iteration", "iteration", s, e, step=self.k)
                    if self.profiling:
                        self.windows.append((s, e))
                        self.profiled_steps += 1
                self.k += 1
            acted = self._window()
            if reopen:
                self.open_t = self.now() if acted else t
                self.rec.step = self.k

    def _window(self) -> bool:
        """Start or stop the profiler at this step boundary; True if it did."""
        w = self.window
        if w is None or not self.tf_ops:
            return False
        first, count = w
        if not self.profiling and self.k >= first and not self.profiled_steps:
            return self.start_profiler()
        if self.profiling and count > 0 and self.profiled_steps >= count:
            self.stop_profiler()
            return True
        return False

    def start_profiler(self) -> bool:
        try:
            import tensorflow as tf

            self.logdir = tempfile.mkdtemp(prefix="gputrace-tf-")
            (self.tf_start or tf.profiler.experimental.start)(self.logdir)
        except Exception as e:  # noqa: BLE001 - e.g. a profiler the job started itself
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            self.notes.append(f"TensorFlow's profiler did not start: {why}")
            print(f"gputrace: TensorFlow's profiler did not start ({why}); iterations are "
                  "recorded without phases", file=sys.stderr)
            self.window = None
            return False
        self.profiling = True
        return True

    def stop_profiler(self) -> None:
        if not self.profiling:
            return
        self.profiling = False
        self.window = None          # one window per process
        try:
            import tensorflow as tf

            tf.profiler.experimental.stop()
            self._convert()
        except Exception as e:  # noqa: BLE001 - never break the job
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            self.notes.append(f"profile not converted: {why}")
            print(f"gputrace: TensorFlow profile not converted ({why}); its phases are lost",
                  file=sys.stderr)
        finally:
            if self.logdir and not os.environ.get("GPUTRACE_TF_KEEP"):
                shutil.rmtree(self.logdir, ignore_errors=True)
        # the shard's metadata is written at its first flush: what the window held is a row
        self.rec.instant("user", "tensorflow.profile", args={
            "steps": self.profiled_steps, "rows": self.converted,
            **({"notes": self.notes} if self.notes else {})})

    def _convert(self) -> None:
        from gputrace.importers import tfprof
        from gputrace.importers.common import Rows
        from gputrace.trace.schema import COLUMN_NAMES

        assert self.logdir is not None
        keep = os.environ.get("GPUTRACE_TF_KEEP")
        r = self.rec
        if keep:
            # one directory per rank: workers on one host write the same file names
            shutil.copytree(self.logdir, keep if r.rank < 0 else
                            os.path.join(keep, f"rank{r.rank}"), dirs_exist_ok=True)
        rows = Rows()
        for path in tfprof.profile_files(self.logdir):
            hosts, devices = tfprof.read_xspace(path)
            for h in hosts:
                c = tfprof.convert(h, rows, rank=r.rank, pid=r.pid, loop_tid=self.loop_tid,
                                   optimizers=self.optimizers, eager=False, iterations=False,
                                   windows=self.windows, comm_bytes=self.comm_bytes)
                for k, v in c.counts.items():
                    self.converted[k] = self.converted.get(k, 0) + v
            for d in devices:
                self.converted["gpu"] = self.converted.get("gpu", 0) + tfprof.gpu_rows(
                    d, rows, rank=r.rank, optimizers=self.optimizers)
        table = rows.table()
        if not table.num_rows:
            return
        cols = [table.column(c).to_pylist() for c in COLUMN_NAMES]
        at = {c: i for i, c in enumerate(COLUMN_NAMES)}
        out = []
        for row in zip(*cols, strict=True):
            row = list(row)
            row[at["host"]] = r.host
            out.append(tuple(row))
        r.add_rows(out)

    def _status(self) -> None:
        w = self.window
        window = "off" if w is None else "all" if w[1] < 0 else f"{w[0]}:{w[1]}"
        self.rec.set_collector("tensorflow", "ok", profiler_steps=window)

    def finish(self, t: int) -> None:
        """The recording closes: the open iteration of a loop that never ended another
        is dropped (what follows the last step is no iteration); the profiler stops."""
        with self.lock:
            self.open_t = None
            self.stop_profiler()


# -- Keras ------------------------------------------------------------------------------------
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
            _quiet_torch_iterations(self._s.rec, True)

        @_safe
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            s = self._s
            t = s.now()
            if self._open:
                s.end_step(t, self._graph, self._steps())   # iterations tile the loop
            else:
                s.begin(t)
                self._open = True

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
                s.end_step(end, self._graph, self._steps(), reopen=False)
            self._open = False
            s.open_t = None

        @_safe
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self._last()

        @_safe
        def on_train_end(self, logs: Any = None) -> None:
            self._last()
            s = self._s
            s.in_fit = max(s.in_fit - 1, 0)
            s.tf_ops = True
            if s.window is not None and s.window[1] < 0 and s.profiling:
                s.stop_profiler()    # `all`: the whole fit
            _quiet_torch_iterations(s.rec, False)

    return GputraceSteps


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

    def batch(self, t: int) -> None: ...
    def exhausted(self) -> None: ...
    def forward(self, t: int, grad: bool) -> None: ...
    def backward(self) -> None: ...
    def stepped(self, t: int) -> None: ...
    def finish(self, t: int) -> None: ...


def _patch_keras(state: _State, keras: Any) -> None:
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
            _fail("Model.fit", e)
        try:
            return orig_fit(self, *args, **kwargs)
        finally:
            if joined is not None:
                _leave(joined.callbacks, mine)

    fit._gputrace = True  # type: ignore[attr-defined]
    model_cls.fit = fit

    opt_cls = keras.optimizers.Optimizer
    base = next((c for c in opt_cls.__mro__ if "apply" in c.__dict__), opt_cls)
    orig_apply = base.apply
    if getattr(orig_apply, "_gputrace", False):
        return
    now = state.now

    @functools.wraps(orig_apply)
    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        how = _before_apply(self)
        out = orig_apply(self, *args, **kwargs)
        if how:
            _after_apply(self, t0, how == "step")
        return out

    apply._gputrace = True  # type: ignore[attr-defined]
    base.apply = apply


@_safe
def _leave(callbacks: list[Any], mine: Any) -> None:
    """The job's CallbackList as it was before fit."""
    callbacks.remove(mine)


@_safe
def _before_apply(opt: Any) -> str | None:
    """How to time this optimizer call: "step" (an eager TensorFlow loop: the update, and
    the iteration's end), "update" (eager, inside fit or on another backend: the update
    only) or None (traced into a tf.function, which it marks as a training step)."""
    s = _state
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
    s = _state
    assert s is not None
    t = s.now()
    if step:
        s.begin(t0)
    s.rec.span("update", type(opt).__name__, t0, t)
    if step:
        s.end_step(t, graph=False)


# -- TensorFlow -------------------------------------------------------------------------------
def _patch_tensorflow(state: _State, tf: Any) -> None:
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
        out = orig_next(self)
        rec.span("io", "tf.data", t0, now())
        return out

    tls = state.tls

    @functools.wraps(orig_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        stack = getattr(tls, "functions", None)
        if stack is None:
            stack = tls.functions = []
        outer = not stack and not state.in_fit
        t0 = now() if outer else 0
        if outer:
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
                    _step_returned(now())

    for fn in (__enter__, gradient, __next__, __call__):
        fn._gputrace = True  # type: ignore[attr-defined]
    tape_cls.__enter__ = __enter__
    tape_cls.gradient = gradient
    iterator_ops.OwnedIterator.__next__ = __next__
    pf.Function.__call__ = __call__


def _patch_collectives(state: _State) -> None:
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
    s = _state
    if s is None:
        return
    try:
        name = out.op.name          # eager tensors have no op: nothing to name in a profile
    except AttributeError:
        return
    n = t.shape.num_elements()
    if n is not None:
        s.comm_bytes[name] = int(n) * t.dtype.size


def _patch_profiler(state: _State) -> None:
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
    s = _state
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
    s = _state
    assert s is not None
    s.begin(t)
    if s.tape_t is None:
        s.tape_t = t


@_safe
def _gradient_done(t0: int, t1: int) -> None:
    s = _state
    assert s is not None
    if s.tape_t is not None:
        # what ran under the tape (model and loss), until its gradient was asked for
        s.rec.span("forward", "GradientTape", s.tape_t, t0)
        s.tape_t = None
    s.rec.span("backward", "GradientTape.gradient", t0, t1)


@_safe
def _batch_requested(t: int) -> None:
    s = _state
    assert s is not None
    s.begin(t)


@_safe
def _step_returned(t: int) -> None:
    s = _state
    assert s is not None
    s.end_step(t, graph=True)


# -- installation ---------------------------------------------------------------------------
def _state_for(rec: Recorder) -> _State:
    global _state
    if _state is None or _state.rec is not rec:
        _state = _State(rec, window_from_env(os.environ.get("GPUTRACE_TF_STEPS")))
        rec.close_hooks.append(_state.finish)
        _state._status()
    return _state


def _refresh_rank(rec: Recorder) -> None:
    """A script that sets TF_CONFIG itself (after gputrace started) has its rank now."""
    if rec.rank >= 0:
        return
    from gputrace.recorder import tf_config_rank

    rank, world = tf_config_rank()
    if rank >= 0:
        rec.rank = rank
        rec.metadata["rank"], rec.metadata["world_size"] = rank, world


def on_tensorflow(rec: Recorder, tf: Any) -> str:
    """Hooks for custom loops (tapes, tf.data iterators, tf.function steps)."""
    _refresh_rank(rec)
    state = _state_for(rec)
    _patch_tensorflow(state, tf)
    # before TensorFlow's own exit handlers (registered at its import, so run after ours)
    atexit.register(state.stop_profiler)
    rec.metadata.setdefault("software", {})["tensorflow"] = getattr(tf, "__version__", "?")
    for patch in (_patch_profiler, _patch_collectives):     # refinements: the rest goes on
        try:
            patch(state)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _fail(patch.__name__, e)
    return "ok"


def on_keras(rec: Recorder, keras: Any) -> str:
    """The fit callback and the optimizer's apply_gradients."""
    state = _state_for(rec)
    _patch_keras(state, keras)
    rec.metadata.setdefault("software", {})["keras"] = getattr(keras, "__version__", "?")
    return "ok"

