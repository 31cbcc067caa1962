"""Pipeline parallelism (torch.distributed.pipelining): what each stage computes per
microbatch, what its schedule is, and which of its collectives go between stages.

- Each microbatch's work on a stage is a `pipeline` span: name `forward`, `backward` or
  `backward_weight` (zero-bubble schedules split the backward), args `{"stage", "mb"}`;
  the module's forward and the backward inside it are recorded as in any loop.
- Each `schedule.step(...)` is a `pipeline` span named `step`, args `{"schedule",
  "microbatches", "stages", "num_stages"}`; the first one's full description (adds `num_stages`, the
  pipeline group's `ranks`, this rank's `order` of actions as torch's schedule lists them)
  goes to the shard's metadata, `pipeline`.
- The schedule's loss (`_maybe_compute_loss`, on the last stage) is a `forward` span named
  `loss`; no other loss span is taken inside a step (the wait for the next stage's
  gradients is no loss computation).
- Send/recv issued while a step runs carry `"pp": {"stage": s}` (the issuing stage when
  known): communication between stages, not a data-parallel exchange.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

from gputrace.collectors.torch import comm, lazy, pp_probe
from gputrace.collectors.torch.comm import TLS
from gputrace.collectors.torch.guard import _hook_failed

STAGE = "torch.distributed.pipelining.stage"
SCHEDULES = "torch.distributed.pipelining.schedules"
_CHUNKS = {"forward_one_chunk": "forward", "backward_one_chunk": "backward",
           "backward_weight_one_chunk": "backward_weight"}


def _chunk(name: str, orig: Any) -> Any:
    @functools.wraps(orig)
    def one_chunk(self: Any, chunk_id: int, *a: Any, **k: Any) -> Any:
        st = comm._state()
        if st is None:
            return orig(self, chunk_id, *a, **k)
        t0 = st.now()
        prev = TLS.pp
        TLS.pp = f',"pp":{{"stage":{int(self.stage_index)}}}'
        if name != "forward":
            st.loss_from = 0     # the schedule's own loss span was taken
        try:
            if name != "forward" or not pp_probe.enabled():
                return orig(self, chunk_id, *a, **k)
            with _probing(st, self, chunk_id):
                return orig(self, chunk_id, *a, **k)
        finally:
            TLS.pp = prev
            try:
                st.rec.span("pipeline", name, t0, st.now(),
                            args=f'{{"stage":{int(self.stage_index)},"mb":{int(chunk_id)}}}')
            except Exception as e:  # noqa: BLE001
                _hook_failed(f"pipeline {name}", e)

    one_chunk._gputrace_orig = orig  # type: ignore[attr-defined]
    return one_chunk


def _probing(st: Any, stage: Any, chunk_id: int) -> Any:
    """`record --pp-probe`: the context that keeps this forward's inputs (pp_probe)."""
    try:
        return pp_probe.chunk(st, stage, chunk_id)
    except Exception as e:  # noqa: BLE001
        _hook_failed("pipeline probe", e)
        return contextlib.nullcontext()


def _patch_stage(mod: Any) -> None:
    cls = mod._PipelineStageBase
    for meth, name in _CHUNKS.items():
        orig = cls.__dict__.get(meth)
        if orig is not None and getattr(orig, "_gputrace_orig", None) is None:
            setattr(cls, meth, _chunk(name, orig))


def _stages(sched: Any) -> list[Any]:
    one = getattr(sched, "_stage", None)
    return [one] if one is not None else list(getattr(sched, "_stages", None) or [])


def describe(sched: Any) -> dict[str, Any]:
    """What a schedule object says of itself: its class, microbatches, this rank's stages,
    the pipeline's stages and group, and this rank's actions in torch's own order."""
    stages = _stages(sched)
    d: dict[str, Any] = {"schedule": type(sched).__name__,
                         "microbatches": int(getattr(sched, "_n_microbatches", 0)),
                         "stages": [int(s.stage_index) for s in stages],
                         "num_stages": int(getattr(sched, "_num_stages", 0) or
                                           (stages[0].num_stages if stages else 0))}
    if stages:
        try:
            from torch.distributed import distributed_c10d as c10d

            group = stages[0].group
            d["ranks"] = c10d.get_process_group_ranks(group or c10d._get_default_group())
            order = (getattr(sched, "pipeline_order", None) or {}).get(stages[0].group_rank)
            if order is not None:
                d["order"] = [None if a is None else str(a) for a in order]
        except Exception:  # noqa: BLE001 - the description is what it could read
            pass
    return d


def _step(orig: Any) -> Any:
    @functools.wraps(orig)
    def step(self: Any, *a: Any, **k: Any) -> Any:
        st = comm._state()
        if st is None or TLS.pp is not None:     # a subclass's step calling its base's
            return orig(self, *a, **k)
        t0 = st.now()
        stages = _stages(self)
        TLS.pp = f',"pp":{{"stage":{int(stages[0].stage_index)}}}' if len(stages) == 1 \
            else ',"pp":{}'
        st.pipeline_steps += 1
        try:
            return orig(self, *a, **k)
        finally:
            TLS.pp = None
            st.pipeline_steps -= 1
            try:
                _record_step(st, self, t0)
            except Exception as e:  # noqa: BLE001
                _hook_failed("pipeline step", e)

    step._gputrace_orig = orig  # type: ignore[attr-defined]
    return step


def _record_step(st: Any, sched: Any, t0: int) -> None:
    d = getattr(sched, "_gputrace_desc", None)
    if d is None:
        d = describe(sched)
        sched._gputrace_desc = d
        st.rec.metadata.setdefault("pipeline", d)
    args = {k: d[k] for k in ("schedule", "microbatches", "stages", "num_stages")}
    st.rec.span("pipeline", "step", t0, st.now(), args=json.dumps(args, separators=(",", ":")))


def _loss(orig: Any) -> Any:
    @functools.wraps(orig)
    def _maybe_compute_loss(self: Any, *a: Any, **k: Any) -> Any:
        st = comm._state()
        if st is None:
            return orig(self, *a, **k)
        t0 = st.now()
        try:
            return orig(self, *a, **k)
        finally:
            st.loss_from = 0
            stage = a[0] if a else k.get("stage")
            if getattr(self, "_loss_fn", None) is not None and getattr(stage, "is_last", False):
                st.rec.span("forward", "loss", t0, st.now())

    _maybe_compute_loss._gputrace_orig = orig  # type: ignore[attr-defined]
    return _maybe_compute_loss


def _patch_schedules(mod: Any) -> None:
    base = mod._PipelineSchedule
    for cls in [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, base)]:
        orig = cls.__dict__.get("step")
        if orig is not None and getattr(orig, "_gputrace_orig", None) is None:
            cls.step = _step(orig)
    orig = base.__dict__.get("_maybe_compute_loss")
    if orig is not None and getattr(orig, "_gputrace_orig", None) is None:
        base._maybe_compute_loss = _loss(orig)


def install() -> None:
    lazy.when_imported(STAGE, _patch_stage, "pipeline stages")
    lazy.when_imported(SCHEDULES, _patch_schedules, "pipeline schedules")
