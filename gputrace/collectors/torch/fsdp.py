"""FSDP units: which unit issued a collective, in which role, and whether it prefetched.

A unit is an FSDP module's parameter group: an `FSDPParamGroup` (FSDP2, `fully_shard`) or a
`FlatParamHandle` (FSDP1, `FullyShardedDataParallel`). While a unit all-gathers its
parameters or reduces its gradients, the unit is set on the thread (`torch_comm.TLS.ctx`)
and the collectives it issues carry it: `layer` = the unit's index, 1..U in the order units
first gather (forward order; 1 nearest the input), and `fsdp`, `unit` (the module's name in
the model, "" for the root), `role` (`unshard`, `reshard_gather`, `reduce_grad`,
`hsdp_all_reduce`) and `prefetch` in args. Under FSDP2 they also carry the unit's settings
as the job set them when the unit issued them (`settings`: `reshard_after_forward`,
`forward_prefetch` and `backward_prefetch`, the units `set_modules_to_forward_prefetch` /
`set_modules_to_backward_prefetch` gave it (null: FSDP2's default), `param_dtype`,
`reduce_dtype`), read from FSDP's own state at each gather and reduction.

FSDP's modules (and c10d's functional collectives, collectors.torch.functional) are patched
when they are imported (collectors.torch.lazy), or at once if they already are.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

from gputrace.collectors.torch import lazy
from gputrace.collectors.torch.comm import TLS, with_tls
from gputrace.collectors.torch.guard import _hook_failed

FSDP2 = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
FSDP1 = "torch.distributed.fsdp._runtime_utils"
_WRAPPER_PARTS = frozenset(("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))

_units: dict[int, _Unit] = {}
_next = [1]
_lock = threading.Lock()
_roots: list[Any] = []      # FSDP1 root modules (to name units)


class _Ctx:
    """What a unit's collectives carry while it issues them in one role."""

    __slots__ = ("layer", "parts")

    def __init__(self, layer: int, parts: dict[str, str], other: str) -> None:
        self.layer = layer
        self.parts = parts
        self.parts[""] = other

    def for_kind(self, kind: str) -> tuple[int, str]:
        p = self.parts.get(kind)
        return self.layer, self.parts[""] if p is None else p


class _Unit:
    __slots__ = ("owner", "index", "head", "ctxs", "seen", "base")

    def __init__(self, owner: Any, index: int, fsdp: str, name: str) -> None:
        self.owner = owner      # keeps id(owner) unique while the unit is known
        self.index = index
        self.base = self.head = f',"fsdp":"{fsdp}","unit":{json.dumps(name)}'
        self.ctxs: dict[tuple[str, bool], _Ctx] = {}
        self.seen: tuple | None = None      # the settings the head carries

    def with_settings(self, key: tuple, text: Any) -> _Unit:
        """The head carrying the settings `key` (`text()` their JSON), made again only when
        they changed."""
        if key != self.seen:
            self.head = f'{self.base},"settings":{text()}'
            self.ctxs = {}
            self.seen = key
        return self

    def ctx(self, role: str, prefetch: bool) -> _Ctx:
        c = self.ctxs.get((role, prefetch))
        if c is None:
            pf = "true" if prefetch else "false"

            def part(r: str) -> str:
                return f'{self.head},"role":"{r}","prefetch":{pf}'

            if role == "reduce_grad":
                parts = {"reduce_scatter": part("reduce_grad"),
                         "all_reduce": part("hsdp_all_reduce")}
            elif role == "reduce_grad_no_shard":
                parts = {"all_reduce": part("reduce_grad")}
            else:
                parts = {"all_gather": part(role)}
            c = self.ctxs[(role, prefetch)] = _Ctx(self.index, parts, self.head)
        return c


def _unit(owner: Any, fsdp: str, name: Any) -> _Unit:
    u = _units.get(id(owner))
    if u is None or u.owner is not owner:
        with _lock:
            index = _next[0]
            _next[0] += 1
        u = _units[id(owner)] = _Unit(owner, index, fsdp, name() if callable(name) else name)
    return u


def _within(ctx_of: Any, orig: Any, where: str) -> Any:
    """`orig`, run with the unit context `ctx_of(*args)` set on the thread."""
    tls = TLS

    @functools.wraps(orig)
    def run(*a: Any, **k: Any) -> Any:
        try:
            ctx = ctx_of(*a)
        except Exception as e:  # noqa: BLE001 - the unit goes unnamed, FSDP runs on
            _hook_failed(where, e)
            ctx = None
        if ctx is None:
            return orig(*a, **k)
        prev = tls.ctx
        tls.ctx = ctx
        try:
            return orig(*a, **k)
        finally:
            tls.ctx = prev

    run._gputrace_orig = orig  # type: ignore[attr-defined]
    return run


def _prefetching(orig: Any) -> Any:
    return with_tls(orig, "prefetch", True)


# -- FSDP2 ----------------------------------------------------------------------------------
def _groups(state: Any) -> list[Any]:
    gs = getattr(state, "_fsdp_param_groups", None)
    if gs is None:    # torch before 2.8: one group per state
        g = getattr(state, "_fsdp_param_group", None)
        gs = [] if g is None else [g]
    return list(gs)


def _fqns(states: Any) -> list[str]:
    return [getattr(g, "_module_fqn", "") or "" for s in states for g in _groups(s)]


def _dtype(d: Any) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


def _settings_of(pg: Any) -> tuple[tuple, Any]:
    """A unit's settings as FSDP2 holds them: a key that changes when they do, and a
    function giving their JSON."""
    mods = getattr(pg, "modules", None) or (getattr(pg, "module", None),)
    state = mods[0]._get_fsdp_state() if mods[0] is not None else None
    fwd = tuple(getattr(state, "_states_to_forward_prefetch", None) or ())
    bwd = tuple(getattr(state, "_states_to_backward_prefetch", None) or ())
    info = pg.post_forward_mesh_info
    reshard: bool | int = info is not None
    if info is not None and info != pg.mesh_info:    # resharded to a smaller group
        reshard = int(getattr(info, "shard_mesh_size", 0) or 0) or True
    mp = pg.mp_policy
    key = (reshard, tuple(map(id, fwd)), tuple(map(id, bwd)), mp.param_dtype, mp.reduce_dtype)

    def text() -> str:
        return json.dumps({"reshard_after_forward": reshard, "forward_prefetch": _fqns(fwd),
                           # none set: FSDP2 prefetches the previous unit (its default)
                           "backward_prefetch": _fqns(bwd) if bwd else None,
                           "param_dtype": _dtype(mp.param_dtype),
                           "reduce_dtype": _dtype(mp.reduce_dtype)}, separators=(",", ":"))
    return key, text


def _patch_fsdp2(mod: Any) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    cls = mod.FSDPParamGroup
    if getattr(cls.unshard, "_gputrace_orig", None) is not None:
        return
    pre_backward = TrainingState.PRE_BACKWARD

    unread: list[bool] = []     # reading the settings failed once: not tried again

    def unit(pg: Any) -> _Unit:
        u = _unit(pg, "fsdp2", lambda: getattr(pg, "_module_fqn", "") or "")
        if unread:
            return u
        try:
            return u.with_settings(*_settings_of(pg))
        except Exception as e:  # noqa: BLE001 - the unit's collectives go without settings
            unread.append(True)
            _hook_failed("FSDP2 settings", e)
            return u

    def unshard_ctx(pg: Any, *a: Any) -> _Ctx:
        role = "reshard_gather" if pg._training_state == pre_backward else "unshard"
        return unit(pg).ctx(role, TLS.prefetch)

    def reduce_ctx(pg: Any, *a: Any) -> _Ctx:
        return unit(pg).ctx("reduce_grad", False)

    cls.unshard = _within(unshard_ctx, cls.unshard, "FSDPParamGroup.unshard")
    cls.post_backward = _within(reduce_ctx, cls.post_backward, "FSDPParamGroup.post_backward")
    prefetch = cls.__dict__.get("_prefetch_unshard")
    if isinstance(prefetch, staticmethod):
        cls._prefetch_unshard = staticmethod(_prefetching(prefetch.__func__))


# -- FSDP1 ----------------------------------------------------------------------------------
def _name_of(module: Any) -> str:
    for root in _roots:
        for name, m in root.named_modules():
            if m is module:
                return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)
    return ""


def _patch_fsdp1(mod: Any) -> None:
    if getattr(mod._unshard, "_gputrace_orig", None) is not None:
        return
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    backward_pre = HandleTrainingState.BACKWARD_PRE

    def unit(handle: Any) -> _Unit:
        module = getattr(handle, "_fully_sharded_module", None)
        return _unit(handle, "fsdp1", lambda: _name_of(module))

    def unshard_ctx(state: Any, handle: Any, *a: Any) -> _Ctx | None:
        if not handle:
            return None
        role = "reshard_gather" if handle._training_state == backward_pre else "unshard"
        return unit(handle).ctx(role, TLS.prefetch)

    def reduce_ctx(state: Any, handle: Any, *a: Any) -> _Ctx | None:
        return unit(handle).ctx("reduce_grad", False) if handle else None

    def no_shard_ctx(state: Any, handle: Any, *a: Any) -> _Ctx | None:
        return unit(handle).ctx("reduce_grad_no_shard", False) if handle else None

    orig_lazy = mod._lazy_init

    @functools.wraps(orig_lazy)
    def _lazy_init(state: Any, root_module: Any) -> Any:
        if not any(r is root_module for r in _roots):
            _roots.append(root_module)
        return orig_lazy(state, root_module)

    mod._lazy_init = _lazy_init
    mod._unshard = _within(unshard_ctx, mod._unshard, "FSDP _unshard")
    mod._reduce_grad = _within(reduce_ctx, mod._reduce_grad, "FSDP _reduce_grad")
    mod._reduce_grad_no_shard = _within(no_shard_ctx, mod._reduce_grad_no_shard,
                                        "FSDP _reduce_grad_no_shard")
    mod._prefetch_handle = _prefetching(mod._prefetch_handle)


def _patch_funcol(mod: Any) -> None:
    from gputrace.collectors.torch import functional as torch_funcol

    torch_funcol.patch(mod)


_PATCHES = {FSDP2: _patch_fsdp2, FSDP1: _patch_fsdp1,
            "torch.distributed._functional_collectives": _patch_funcol}


def install() -> None:
    for name, fn in _PATCHES.items():
        what = "functional collectives" if fn is _patch_funcol else "FSDP units"
        lazy.when_imported(name, fn, what)
