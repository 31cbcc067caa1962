"""c10d's functional collectives (torch.distributed._functional_collectives, used eagerly by
DTensor and tensor parallelism) as `comm` spans, like the other collectives.

Each call returns at once with an AsyncCollectiveTensor; the collective's Work is kept in
c10d's own registry, out of Python's reach. The span runs from the call to the return of
the `wait_tensor` that first uses the result (the completion as far as the job can see it),
and that wait is its `wait` (the time the job stood still for it), the issuing call its
`call` ([start, end] ns: the thread in the collective before it returned). A result never
used is never written. Issued by a DTensor redistribution, it says `"issuer":"dtensor"`. Inside compiled graphs the collectives are not Python calls: not recorded.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

from gputrace.collectors.torch import comm as torch_comm
from gputrace.collectors.torch.guard import _hook_failed

MODULE = "torch.distributed._functional_collectives"
# name -> (kind, position of the group argument)
_SPECS = {"broadcast": ("broadcast", 2), "all_reduce": ("all_reduce", 2),
          "all_gather_single": ("all_gather", 2), "reduce_scatter_single": ("reduce_scatter", 3),
          "all_to_all_single": ("all_to_all", 3)}
_pending: dict[int, tuple[Any, torch_comm._Entry]] = {}
_DTENSOR = ',"issuer":"dtensor"'   # issued by a DTensor redistribution (collectors.torch.dtensor)
_names: dict[Any, str] = {}
_native_tid = threading.get_native_id


def _group_json(mod: Any, group: Any, tag: str) -> str:
    try:
        key = group if not isinstance(group, list) else tuple(group)
        hash(key)
    except TypeError:
        key = None
    s = _names.get(key) if key is not None else None
    if s is None:
        c10d = torch_comm._c10d[0]
        name = mod._resolve_group_name(group, tag)
        s = torch_comm._group_json(c10d._resolve_process_group(name))
        if key is not None:
            _names[key] = s
    return s


def _wrap(mod: Any, name: str, orig: Any) -> Any:
    kind, gpos = _SPECS[name]
    tls = torch_comm.TLS
    act = mod.AsyncCollectiveTensor

    @functools.wraps(orig)
    def collective(*a: Any, **k: Any) -> Any:
        if tls.busy:
            return orig(*a, **k)
        st = torch_comm._state()
        if st is None:
            return orig(*a, **k)
        t0 = st.now()
        tls.busy = True
        try:
            res = orig(*a, **k)
        finally:
            tls.busy = False
        t1 = st.now()
        try:
            _record(mod, st, kind, a, k, gpos, t0, t1, res, act)
        except Exception as e:  # noqa: BLE001 - the collective ran; only its record is lost
            _hook_failed(f"_functional_collectives.{name}", e)
        return res

    collective._gputrace_orig = orig  # type: ignore[attr-defined]
    return collective


def _record(mod: Any, st: Any, kind: str, a: tuple[Any, ...], k: dict[str, Any], gpos: int,
            t0: int, t1: int, res: Any, act: Any) -> None:
    rec = st.rec
    x = a[0] if a else k.get("self")
    group = a[gpos] if len(a) > gpos else k.get("group")
    tag = a[gpos + 1] if len(a) > gpos + 1 else k.get("tag", "")
    waiting = isinstance(res, act)
    out = res.elem if waiting else res
    ctx = torch_comm.TLS.ctx
    layer, fsdp = (-1, "") if ctx is None else ctx.for_kind(kind)
    call = f',"call":[{t0},{t1}]' if waiting else ""   # the issuing call (a copy, the enqueue)
    head = (f'{{"kind":"{kind}","bytes_out":{torch_comm._nb(out)},'
            f'"group":{_group_json(mod, group, tag)},"async":{"true" if waiting else "false"},'
            f'"functional":true,"phase":"{torch_comm._phase(st)}"{fsdp}'
            f'{_DTENSOR if torch_comm.TLS.dtensor else ""}{call}')
    nin = torch_comm._nb(x)
    if not waiting:
        rec.span("comm", kind, t0, t1, layer=layer, nbytes=nin, args=head + "}")
        return
    tid = _native_tid()
    if tid not in rec.threads:
        rec._new_thread(tid)
    e = torch_comm._Entry(rec, kind, t0, tid, rec.step, layer, nin, head)
    if len(_pending) > 4096:     # results dropped unused: forget them
        for key in [key for key, (ref, _) in _pending.items() if ref() is None]:
            _pending.pop(key, None)
    # by storage: the first use may wait on a view of the result (DTensor unpads it)
    _pending[out.untyped_storage().data_ptr()] = (weakref.ref(out), e)


def _storage(t: Any) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage: not one of ours
        return -1


def _wrap_wait(orig: Any) -> Any:
    @functools.wraps(orig)
    def wait_tensor(tensor: Any) -> Any:
        p = _pending.pop(_storage(tensor), None) if _pending else None
        if p is None:
            return orig(tensor)
        e = p[1]
        ws = torch_comm._state_now()
        try:
            return orig(tensor)
        finally:
            try:
                e.ws, e.we = ws, torch_comm._state_now()
                e.emit(e.we, True)
            except Exception as x:  # noqa: BLE001
                _hook_failed("_functional_collectives.wait_tensor", x)

    wait_tensor._gputrace_orig = orig  # type: ignore[attr-defined]
    return wait_tensor


def patch(mod: Any) -> None:
    """Wrap the functional collectives of `mod` (the module, once imported)."""
    try:
        if getattr(mod.wait_tensor, "_gputrace_orig", None) is not None:
            return
        for name in _SPECS:
            orig = getattr(mod, name, None)
            if orig is not None:
                setattr(mod, name, _wrap(mod, name, orig))
        mod.wait_tensor = _wrap_wait(mod.wait_tensor)
    except Exception as e:  # noqa: BLE001
        _hook_failed("functional collectives", e)
