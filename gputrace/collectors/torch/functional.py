"""c10d's functional collectives (torch.distributed._functional_collectives, used eagerly by
DTensor and tensor parallelism) as `comm` spans, like the other collectives.

Each call returns at once with an AsyncCollectiveTensor; the collective's Work is kept in
c10d's own registry, out of Python's reach. The span runs from the call to the return of
the `wait_tensor` that first uses the result (the completion as far as the job can see it),
and that wait is its `wait` (the time the job stood still for it), the issuing call its
`call` ([start, end] ns: the thread in the collective before it returned). A result never
used is never written. Issued by a DTensor redistribution, it says `"issuer":"dtensor"`. Inside compiled graphs the collectives are not Python calls: not recorded.

An `all_to_all_single` carries `peers`, `splits` (`even` where no split sizes were given) and
`integer` as the ProcessGroup's does (collectors.torch.comm_args). Where its result has a
gradient (`all_to_all_single_autograd`, torchtitan's token dispatch and combine), autograd
runs the reverse all-to-all in the backward inside C++, out of Python's reach: its node's
pre-hook and hook bound it, a span of its own (`"autograd":true`, the gradient's bytes, the
forward's splits swapped).
"""

from __future__ import annotations

import functools
import json
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
    if kind == "all_to_all":
        pg = _pg(mod, group, tag)
        ins = a[2] if len(a) > 2 else k.get("input_split_sizes")
        outs = a[1] if len(a) > 1 else k.get("output_split_sizes")
        head += _a2a(x, ins, pg)
        _backward_a2a(mod, st, out, group, tag, outs, pg)
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


def _pg(mod: Any, group: Any, tag: str) -> Any:
    try:
        return torch_comm._c10d[0]._resolve_process_group(mod._resolve_group_name(group, tag))
    except Exception:  # noqa: BLE001 - a group we cannot resolve: even splits unknown
        return None


def _a2a(x: Any, splits: Any, pg: Any) -> str:
    """`,"peers":[...],"splits":[...]` (`,"even":true` without split sizes) and
    `,"integer":true` of an all_to_all_single's input `x`, "" when not known."""
    try:
        rows = x.shape[0] if x.dim() else 1
        per_row = torch_comm._nb(x) // max(rows, 1)
        even = "" if splits else ',"even":true'
        if not splits:
            n = pg.size()
            splits = [rows // n] * n
        sp = [int(v) for v in splits]
        integer = "" if x.is_floating_point() or x.is_complex() else ',"integer":true'
        return (f',"peers":{json.dumps([v * per_row for v in sp])}'
                f',"splits":{json.dumps(sp)}{even}{integer}')
    except Exception:  # noqa: BLE001 - a shape we do not know: the total bytes stay
        return ""


def _backward_a2a(mod: Any, st: Any, out: Any, group: Any, tag: str, splits: Any,
                  pg: Any) -> None:
    """The reverse all-to-all autograd runs for `out`'s gradient: a span from its node's
    pre-hook to its hook, sending the gradient with the forward's output splits."""
    node = getattr(out, "grad_fn", None)
    if node is None:
        return
    box: list[int] = []

    def pre(grad_outputs: Any) -> None:
        s = torch_comm._state()
        if s is not None:
            box[:] = [s.now()]

    def post(grad_inputs: Any, grad_outputs: Any) -> None:
        try:
            s = torch_comm._state()
            if s is None or not box:
                return
            t1, g = s.now(), grad_outputs[0]
            gi = grad_inputs[0] if grad_inputs else None
            args = (f'{{"kind":"all_to_all","bytes_out":{torch_comm._nb(gi)},'
                    f'"group":{_group_json(mod, group, tag)},"async":false,'
                    f'"functional":true,"autograd":true,"phase":"{torch_comm._phase(s)}"'
                    f'{_a2a(g, splits, pg)}}}')
            s.rec.span("comm", "all_to_all", box[0], t1, nbytes=torch_comm._nb(g), args=args)
        except Exception as e:  # noqa: BLE001 - the backward ran; only its record is lost
            _hook_failed("_functional_collectives.all_to_all_single (backward)", e)

    node.register_prehook(pre)
    node.register_hook(post)


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
