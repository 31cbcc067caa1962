"""DeepSpeed's pipeline engine (`deepspeed.pipe.PipelineModule` trained with
`engine.train_batch()`) recorded as torch.distributed.pipelining's schedules are
(collectors.torch.pipeline's contract), with no change to the job:

- `train_batch` is the schedule's step: a `pipeline` span named `step`, args `{"schedule"
  (the instruction schedule's class, TrainSchedule), "microbatches"
  (gradient_accumulation_steps), "stages" ([this rank's stage]), "num_stages"}`; the first
  one's description (adds the pipeline group's `ranks`) goes to the shard's metadata,
  `pipeline`.
- Each ForwardPass and BackwardPass instruction is a `pipeline` span `forward` /
  `backward`, args `{"stage", "mb"}`: the microbatch is the pass's rank among this step's
  passes of its kind (DeepSpeed's buffer id is a slot that microbatches reuse); the last
  stage's loss function is a `forward` span named `loss`.
- The sends and receives between stages (SendActivation, RecvActivation, SendGrad,
  RecvGrad; DeepSpeed's p2p: torch.distributed send/recv) carry `"pp": {"stage": s}`, as
  does any other collective of the step on the pipeline group's ranks (the loss broadcast
  from the last stage, the gradient norm's and overflow flag's all-reduces across stages).
- With `record --pp-probe`, a ForwardPass keeps the stage module's inputs as a
  PipelineStage's forward chunk does (collectors.torch.pp_probe): the engine's module is
  timed at other microbatch sizes after the last iteration.
- ReduceTiedGrads/ReduceGrads through OptimizerStep are the update (the engine's step,
  collectors.torch's engine_step): the iteration is one train_batch.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

from gputrace.collectors.torch import comm, lazy, pp_probe
from gputrace.collectors.torch.comm import TLS
from gputrace.collectors.torch.guard import _hook_failed

ENGINE = "deepspeed.runtime.pipe.engine"
UPDATE = "PipelineEngine.step"


class _Step:
    """One train_batch on this rank: its passes so far, whether its update is open."""

    __slots__ = ("fwd", "bwd", "sched", "updating")

    def __init__(self) -> None:
        self.fwd = self.bwd = 0
        self.sched: Any = None
        self.updating = False


def _cur(engine: Any) -> _Step | None:
    return engine.__dict__.get("_gputrace_step")


def _pass(kind: str, orig: Any) -> Any:
    @functools.wraps(orig)
    def exec_pass(self: Any, *a: Any, **k: Any) -> Any:
        st, cur = comm._state(), _cur(self)
        if st is None or cur is None:
            return orig(self, *a, **k)
        mb = cur.fwd if kind == "forward" else cur.bwd
        if kind == "forward":
            cur.fwd += 1
        else:
            cur.bwd += 1
        try:
            stage = int(self.stage_id)
            restore = _time_loss(self, st) if kind == "forward" and self.is_last_stage() \
                else None
        except Exception as e:  # noqa: BLE001 - the pass runs, unrecorded
            _hook_failed(f"pipeline {kind}", e)
            return orig(self, *a, **k)
        t0 = st.now()
        try:
            if kind != "forward" or not pp_probe.enabled():
                return orig(self, *a, **k)
            with _probing(st, self, mb):
                return orig(self, *a, **k)
        finally:
            if restore is not None:
                restore()
            try:
                st.rec.span("pipeline", kind, t0, st.now(),
                            args=f'{{"stage":{stage},"mb":{mb}}}')
            except Exception as e:  # noqa: BLE001
                _hook_failed(f"pipeline {kind}", e)

    exec_pass._gputrace_orig = orig  # type: ignore[attr-defined]
    return exec_pass


class _Stage:
    """What the pipeline probe reads of a stage (a PipelineStage's names): the engine's
    stage, its module (this rank's layers) and its microbatches."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage_index = int(engine.stage_id)
        self.submod = engine.module
        self.chunks = int(engine.micro_batches)

    @property
    def refuse(self) -> str:
        """Why the stage is not probed ("" when it is), read by the probe only at the
        forward whose inputs it keeps: ZeRO's gradient hooks reduce or copy gradients as the
        backward makes them, so a backward of the probe's own would communicate, or write
        into ZeRO's buffers."""
        hooks = getattr(getattr(self.engine, "optimizer", None), "_grad_acc_hooks", None)
        return (f"DeepSpeed's ZeRO stage {self.engine.zero_optimization_stage()} hooks the "
                "gradients (the probe's backward would reduce them)" if hooks else "")


def _probing(st: Any, engine: Any, mb: int) -> Any:
    """`record --pp-probe`: the context that keeps this forward pass's inputs (pp_probe)."""
    try:
        return pp_probe.chunk(st, _Stage(engine), mb)
    except Exception as e:  # noqa: BLE001
        _hook_failed("pipeline probe", e)
        return contextlib.nullcontext()


def _time_loss(engine: Any, st: Any) -> Any:
    """The module's loss function as a `forward` span named `loss` for this pass; returns
    what puts the job's own function back."""
    mod = engine.module
    own = "loss_fn" in mod.__dict__     # else none, or an nn.Module loss (in _modules)
    fn = getattr(mod, "loss_fn", None)
    if fn is None:
        return None

    def loss_fn(*a: Any, **k: Any) -> Any:
        t0 = st.now()
        try:
            return fn(*a, **k)
        finally:
            st.loss_from = 0
            st.rec.span("forward", "loss", t0, st.now())

    mod.__dict__["loss_fn"] = loss_fn

    def restore() -> None:
        if own:
            mod.__dict__["loss_fn"] = fn
        else:
            mod.__dict__.pop("loss_fn", None)

    return restore


def _update(begin: bool, orig: Any) -> Any:
    """ReduceTiedGrads/ReduceGrads open the update (begin), OptimizerStep closes it."""

    @functools.wraps(orig)
    def exec_update(self: Any, *a: Any, **k: Any) -> Any:
        st, cur = comm._state(), _cur(self)
        if st is None or cur is None:
            return orig(self, *a, **k)
        if not cur.updating:
            cur.updating = True
            st.engine_step(True, UPDATE)
        if begin:
            return orig(self, *a, **k)
        comm._updating[0] += 1
        try:
            return orig(self, *a, **k)
        finally:
            comm._updating[0] = max(comm._updating[0] - 1, 0)
            cur.updating = False
            st.engine_step(False, UPDATE)

    exec_update._gputrace_orig = orig  # type: ignore[attr-defined]
    return exec_update


def describe(engine: Any, sched: Any) -> dict[str, Any]:
    """What the engine says of its pipeline: the schedule's class, microbatches, this
    rank's stage, the stages and the pipeline group's ranks."""
    d: dict[str, Any] = {"schedule": type(sched).__name__ if sched is not None else
                         "TrainSchedule",
                         "microbatches": int(engine.micro_batches),
                         "stages": [int(engine.stage_id)],
                         "num_stages": int(engine.num_stages)}
    try:
        d["ranks"] = [int(r) for r in engine.grid.pp_group]
    except Exception:  # noqa: BLE001 - the description is what it could read
        pass
    return d


def _train_batch(orig: Any) -> Any:
    @functools.wraps(orig)
    def train_batch(self: Any, *a: Any, **k: Any) -> Any:
        st = comm._state()
        if st is None or _cur(self) is not None:
            return orig(self, *a, **k)
        try:
            tag = f',"pp":{{"stage":{int(self.stage_id)}}}'
        except Exception as e:  # noqa: BLE001 - the step runs, unrecorded
            _hook_failed("pipeline step", e)
            return orig(self, *a, **k)
        cur = self.__dict__["_gputrace_step"] = _Step()
        t0 = st.now()
        prev = TLS.pp, TLS.pp_ranks
        TLS.pp, TLS.pp_ranks = tag, _pipe_ranks(self)
        st.pipeline_steps += 1
        try:
            return orig(self, *a, **k)
        finally:
            TLS.pp, TLS.pp_ranks = prev
            st.pipeline_steps -= 1
            self.__dict__.pop("_gputrace_step", None)
            if cur.updating:     # an OptimizerStep that raised: close the update
                st.engine_step(False, UPDATE)
            try:
                _record_step(st, self, cur, t0)
            except Exception as e:  # noqa: BLE001
                _hook_failed("pipeline step", e)

    train_batch._gputrace_orig = orig  # type: ignore[attr-defined]
    return train_batch


def _pipe_ranks(engine: Any) -> tuple[int, ...] | None:
    try:
        r = tuple(int(x) for x in engine.grid.pp_group)
    except Exception:  # noqa: BLE001 - then only its sends and receives are tagged
        return None
    return r if len(r) > 1 else None


def _record_step(st: Any, engine: Any, cur: _Step, t0: int) -> None:
    d = engine.__dict__.get("_gputrace_desc")
    if d is None:
        d = engine.__dict__["_gputrace_desc"] = describe(engine, cur.sched)
        st.rec.metadata.setdefault("pipeline", d)
    args = {k: d[k] for k in ("schedule", "microbatches", "stages", "num_stages")}
    st.rec.span("pipeline", "step", t0, st.now(), args=json.dumps(args, separators=(",", ":")))


def _exec_schedule(orig: Any) -> Any:
    @functools.wraps(orig)
    def exec_schedule(self: Any, pipe_schedule: Any, *a: Any, **k: Any) -> Any:
        cur = _cur(self)
        if cur is not None and cur.sched is None:
            cur.sched = pipe_schedule
        return orig(self, pipe_schedule, *a, **k)

    exec_schedule._gputrace_orig = orig  # type: ignore[attr-defined]
    return exec_schedule


def _patch(mod: Any) -> None:
    cls = mod.PipelineEngine
    for name, wrap in (("train_batch", _train_batch), ("_exec_schedule", _exec_schedule)):
        orig = cls.__dict__.get(name)
        if orig is not None and getattr(orig, "_gputrace_orig", None) is None:
            setattr(cls, name, wrap(orig))
    # the engine runs each instruction through this map (not its methods by name)
    s = mod.schedule
    wraps = {s.ForwardPass: functools.partial(_pass, "forward"),
             s.BackwardPass: functools.partial(_pass, "backward"),
             s.ReduceTiedGrads: functools.partial(_update, True),
             s.ReduceGrads: functools.partial(_update, True),
             s.OptimizerStep: functools.partial(_update, False)}
    imap = cls.__dict__.get("_INSTRUCTION_MAP") or {}
    for instr, wrap in wraps.items():
        orig = imap.get(instr)
        if orig is not None and getattr(orig, "_gputrace_orig", None) is None:
            imap[instr] = wrap(orig)


def install() -> None:
    lazy.when_imported(ENGINE, _patch, "DeepSpeed pipeline engine")
