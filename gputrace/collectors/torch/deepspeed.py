"""DeepSpeed's engine understood with no change to the job: `engine(x)` is the forward (the
engine is the model's root module), `engine.backward(loss)` the backward (its autograd and
its gradient reduction), `engine.step()` the update (the optimizer, the gradient norm and
overflow checks, ZeRO's parameter all-gathers), one iteration per step whatever optimizer
steps run inside it.

ZeRO's collectives carry FSDP's contract (`fsdp`: `zero1`, `zero2`, `zero3`; `unit`,
`role`, `layer`) so that the sharded analysis reads them as sharded data parallelism:
- stage 3: a submodule's parameters gathered before its forward (`unshard`) and again in
  the backward (`reshard_gather`), unit = the submodule (numbered in first-fetch order); a
  gather of later submodules' parameters issued inside a fetch is a prefetch (`prefetch`
  true, unit = the first submodule it serves); each fetch is a `user` span `zero3.fetch`
  (layer = its unit; args: `forward`, `params` [[ds_id, numel, persistent], ...] of the
  submodule's own), the parameter trace the ZeRO-3 prefetch what-ifs replay;
- every stage: the gradients reduced in the backward (`reduce_grad`: reduce-scatter, or
  all-reduce), unit = the reduction bucket in its order within the backward;
- in the step, the updated partitions all-gathered (`step_gather`: stages 1 and 2; stage
  3's persistent parameters, those under stage3_param_persistence_threshold).
Collectives of a few bytes (a gradient norm, an overflow flag) are left untagged: they are
no unit of anything. The engine's ZeRO settings go to the shard's metadata, `deepspeed`."""

from __future__ import annotations

import functools
import json
import threading
import weakref
from typing import Any

from gputrace.collectors.torch import comm, lazy
from gputrace.collectors.torch.comm import TLS
from gputrace.collectors.torch.guard import _hook_failed

ENGINE = "deepspeed.runtime.engine"
COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
FETCH_SPAN = "zero3.fetch"    # a ZeRO-3 submodule's parameter fetch (a `user` span)
SETTINGS = ("stage", "overlap_comm", "reduce_bucket_size", "allgather_bucket_size",
            "reduce_scatter", "contiguous_gradients", "stage3_prefetch_bucket_size",
            "stage3_max_live_parameters", "stage3_max_reuse_distance",
            "stage3_param_persistence_threshold")


class _Ctx:
    """The tags the collectives of one ZeRO role carry (collectors.torch.fsdp's contract)."""

    __slots__ = ("layer", "parts")
    min_bytes = 1024    # smaller: a norm or a flag, untagged (analyzers.core.collectives.SMALL_BYTES)

    def __init__(self, stage: int, unit: str, layer: int, roles: dict[str, str],
                 prefetch: bool = False) -> None:
        head = f',"fsdp":"zero{stage}","unit":{json.dumps(unit)}'
        self.layer = layer
        pf = "true" if prefetch else "false"
        self.parts = {k: f'{head},"role":"{r}","prefetch":{pf}' for k, r in roles.items()}

    def for_kind(self, kind: str) -> tuple[int, str]:
        p = self.parts.get(kind)
        return (self.layer, p) if p is not None else (-1, "")


class _Engine:
    """Per engine: its stage, its units (by submodule), its reduction buckets per backward;
    under ZeRO-3, per submodule its gather contexts, its own parameters and its fetch args."""

    def __init__(self, engine: Any) -> None:
        self.stage = int(engine.zero_optimization_stage() or 0)
        self.units: dict[int, tuple[int, str]] = {}
        self.modules = dict(engine.module.named_modules())
        self.names = {id(m): n for n, m in self.modules.items()}
        self.owner = {id(p): m for m in self.modules.values()
                      for p in m.parameters(recurse=False)}
        self.bucket = 0
        self.ctxs: dict[tuple[int, str, bool], _Ctx] = {}
        self.own: dict[int, frozenset[int]] = {}
        self.args: dict[tuple[int, bool], str] = {}

    def unit(self, module: Any) -> tuple[int, str]:
        got = self.units.get(id(module))
        if got is None:
            got = self.units[id(module)] = (len(self.units) + 1,
                                            self.names.get(id(module), type(module).__name__))
        return got

    def ctx(self, module: Any, role: str, prefetch: bool) -> _Ctx:
        c = self.ctxs.get((id(module), role, prefetch))
        if c is None:
            layer, name = self.unit(module)
            c = self.ctxs[(id(module), role, prefetch)] = _Ctx(3, name, layer,
                                                                {"all_gather": role}, prefetch)
        return c

    def fetched(self, module: Any, params_of: Any, forward: bool) -> tuple[frozenset[int],
                                                                             str]:
        """The ids of a submodule's own parameters (those its fetch gathers: `params_of`),
        and its fetch span's args; made once per submodule and direction."""
        own = self.own.get(id(module))
        a = self.args.get((id(module), forward))
        if own is not None and a is not None:
            return own, a
        params = params_of(module)
        if own is None:
            own = self.own[id(module)] = frozenset(id(p) for p in params)
        if a is None:
            ps = sorted([int(getattr(p, "ds_id", -1)), int(getattr(p, "ds_numel", p.numel())),
                          int(bool(getattr(p, "ds_persist", False)))] for p in params)
            a = self.args[(id(module), forward)] = json.dumps(
                {"forward": forward, "params": ps}, separators=(",", ":"))
        return own, a


def _state_of(engine: Any) -> _Engine | None:
    s = engine.__dict__.get("_gputrace")
    if s is None:
        try:
            s = engine.__dict__["_gputrace"] = _Engine(engine)
            _describe(engine, s)
        except Exception as e:  # noqa: BLE001 - the engine works; its collectives go untagged
            _hook_failed("DeepSpeed engine", e)
            return None
    return s


def _describe(engine: Any, s: _Engine) -> None:
    st = comm._state()
    if st is None:
        return
    cfg = getattr(engine, "_config", None)
    z = getattr(cfg, "zero_config", None)
    d: dict[str, Any] = {"stage": s.stage}
    for k in SETTINGS[1:]:
        # the config's fields drop the stage3_ of the names its JSON is written with
        v = getattr(z, k, getattr(z, k.removeprefix("stage3_"), None))
        if isinstance(v, (bool, int, float)):
            d[k] = v
    d["gradient_accumulation_steps"] = int(engine.gradient_accumulation_steps())
    # stages 1-2 split the step's all-gathers by allgather_bucket_size only without it
    d["all_gather_into_tensor"] = _has_gather_into_tensor()
    p = next(iter(engine.module.parameters()), None)
    if p is not None:   # reduce_bucket_size counts elements: the bytes of one
        d["element_size"] = int(p.element_size())
    st.rec.metadata.setdefault("deepspeed", d)


def _has_gather_into_tensor() -> bool | None:
    try:
        from deepspeed import comm as ds_comm

        return bool(ds_comm.has_all_gather_into_tensor())
    except Exception:  # noqa: BLE001 - not known: the what-if says so
        return None


def _within(ctx: Any, fn: Any, *a: Any, **k: Any) -> Any:
    prev = TLS.ctx
    TLS.ctx = ctx
    try:
        return fn(*a, **k)
    finally:
        TLS.ctx = prev


def _backward(orig: Any) -> Any:
    @functools.wraps(orig)
    def backward(self: Any, *a: Any, **k: Any) -> Any:
        st, s = comm._state(), _state_of(self)
        if st is None or s is None:
            return orig(self, *a, **k)
        s.bucket = 0
        ctx = _Ctx(s.stage, "gradients", -1, {"reduce_scatter": "reduce_grad",
                                              "all_reduce": "reduce_grad"})
        st.backward_enter()      # the engine's backward is the backward: its reduction too
        try:
            return _within(ctx, orig, self, *a, **k)
        finally:
            st.backward_exit()

    backward._gputrace_orig = orig  # type: ignore[attr-defined]
    return backward


def _step(orig: Any) -> Any:
    @functools.wraps(orig)
    def step(self: Any, *a: Any, **k: Any) -> Any:
        st, s = comm._state(), _state_of(self)
        if st is None or s is None:
            return orig(self, *a, **k)
        # stages 1 and 2: the updated partitions; stage 3: its persistent (small) parameters
        ctx = _Ctx(s.stage, "parameters", -1, {"all_gather": "step_gather"})
        st.engine_step(True, "DeepSpeedEngine.step")   # the update, once
        comm._updating[0] += 1
        try:
            return _within(ctx, orig, self, *a, **k)
        finally:
            comm._updating[0] = max(comm._updating[0] - 1, 0)
            st.engine_step(False, "DeepSpeedEngine.step")

    step._gputrace_orig = orig  # type: ignore[attr-defined]
    return step


def _patch_engine(mod: Any) -> None:
    cls = mod.DeepSpeedEngine
    for name, wrap in (("backward", _backward), ("step", _step)):
        orig = cls.__dict__.get(name)
        if orig is not None and getattr(orig, "_gputrace_orig", None) is None:
            setattr(cls, name, wrap(orig))


class _Fetching(threading.local):
    cur: tuple[_Engine, Any, bool, frozenset[int]] | None = None   # engine, submodule, forward


_FETCHING = _Fetching()


def _fetch(orig: Any, params_of: Any) -> Any:
    @functools.wraps(orig)
    def fetch_sub_module(self: Any, current_submodule: Any, forward: bool, *a: Any,
                         **k: Any) -> Any:
        st = comm._state()
        eng = _engine_of_module(current_submodule)
        if st is None or eng is None:
            return orig(self, current_submodule, forward, *a, **k)
        try:
            own, args = eng.fetched(current_submodule, params_of, forward)
            ctx = eng.ctx(current_submodule, "unshard" if forward else "reshard_gather", False)
        except Exception as e:  # noqa: BLE001 - the fetch runs; its gathers go untagged
            _hook_failed("DeepSpeed ZeRO-3 parameters", e)
            return orig(self, current_submodule, forward, *a, **k)
        prev = _FETCHING.cur
        _FETCHING.cur = (eng, current_submodule, forward, own)
        t0 = st.rec.now_ns()
        try:
            return _within(ctx, orig, self, current_submodule, forward, *a, **k)
        finally:
            _FETCHING.cur = prev
            st.rec.span("user", FETCH_SPAN, t0, st.rec.now_ns(), layer=ctx.layer, args=args)

    fetch_sub_module._gputrace_orig = orig  # type: ignore[attr-defined]
    return fetch_sub_module


def _gather(orig: Any) -> Any:
    """The coordinator's all-gather of a set of parameters: inside a fetch, of parameters
    not the fetched submodule's own, it is a prefetch (unit: the submodule owning the first
    of them in the fetch's direction, by DeepSpeed's parameter ids)."""
    @functools.wraps(orig)
    def all_gather_params(self: Any, params: Any, forward: bool, *a: Any, **k: Any) -> Any:
        cur = _FETCHING.cur
        if cur is None:
            return orig(self, params, forward, *a, **k)
        try:
            eng, _, fwd, own = cur
            ps = list(params)
            ctx = None
            if ps and not all(id(p) in own for p in ps):
                first = (min if fwd else max)(ps, key=lambda p: getattr(p, "ds_id", 0))
                m = eng.owner.get(id(first))
                if m is not None:
                    ctx = eng.ctx(m, "unshard" if fwd else "reshard_gather", True)
        except Exception as e:  # noqa: BLE001 - the gather runs, tagged as the fetch's own
            _hook_failed("DeepSpeed ZeRO-3 prefetch", e)
            ctx = None
        if ctx is None:
            return orig(self, params, forward, *a, **k)
        return _within(ctx, orig, self, params, forward, *a, **k)

    all_gather_params._gputrace_orig = orig  # type: ignore[attr-defined]
    return all_gather_params


_engines: list[Any] = []     # weak references to the engines whose modules fetch parameters


def _engine_of_module(m: Any) -> _Engine | None:
    for ref in list(_engines):
        e = ref()
        if e is None:
            _engines.remove(ref)
            continue
        s = e.__dict__.get("_gputrace")
        if s is not None and id(m) in s.names:
            return s
    return None


def _patch_coordinator(mod: Any) -> None:
    cls = mod.PartitionedParameterCoordinator

    def params_of(m: Any) -> list[Any]:   # what the coordinator's fetch gathers of m
        return list(mod.iter_params(m, recurse=mod.z3_leaf_module(m)))

    orig = cls.__dict__.get("fetch_sub_module")
    if orig is not None and getattr(orig, "_gputrace_orig", None) is None:
        cls.fetch_sub_module = _fetch(orig, params_of)
    name = "_PartitionedParameterCoordinator__all_gather_params"
    orig = cls.__dict__.get(name)
    if orig is not None and getattr(orig, "_gputrace_orig", None) is None:
        setattr(cls, name, _gather(orig))


def _patch_init(mod: Any) -> None:
    cls = mod.DeepSpeedEngine
    orig = cls.__init__
    if getattr(orig, "_gputrace_orig", None) is not None:
        return

    @functools.wraps(orig)
    def __init__(self: Any, *a: Any, **k: Any) -> None:
        orig(self, *a, **k)
        try:
            _engines.append(weakref.ref(self))
            _state_of(self)
        except Exception as e:  # noqa: BLE001
            _hook_failed("DeepSpeed engine", e)

    __init__._gputrace_orig = orig  # type: ignore[attr-defined]
    cls.__init__ = __init__


def install() -> None:
    lazy.when_imported(ENGINE, lambda m: (_patch_engine(m), _patch_init(m)), "DeepSpeed engine")
    lazy.when_imported(COORDINATOR, _patch_coordinator, "DeepSpeed ZeRO-3 parameters")
