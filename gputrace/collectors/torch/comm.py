"""Every torch.distributed collective the job issues, as one `comm` span.

The public collectives of `torch.distributed` (all_reduce, all_gather[_single|_into_tensor],
reduce_scatter[_single|_tensor], broadcast, all_to_all[_single], send/recv/isend/irecv,
batch_isend_irecv, barrier, reduce, gather, scatter) are replaced, in `distributed_c10d` and
in the `torch.distributed` namespace alike, by a wrapper that times the call on the issuing
thread. A synchronous call is a span over the call. An asynchronous one (a `Work` returned)
ends when the job's `wait()` on it returns or its future completes, whichever is seen first;
the job's wait is kept as `args.wait` when the work was still running when it began (the
time its compute stood still for it).

A collective issued inside another (all_gather_into_tensor calls all_gather_single) or by a
DistributedDataParallel comm hook (its buckets are timed there) is not recorded again. The
record's fields are described in the trace format's comm contract: name/`kind`, `bytes`
(this rank's input), `bytes_out`, `group`, `async`, `phase`, `wait`, and for FSDP the unit
(`layer`, `fsdp`, `unit`, `role`, `prefetch`), which torch_fsdp sets on the thread while a
unit issues its collectives; a batch_isend_irecv's one record says how many sends and
receives it holds (`ops`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from gputrace.collectors.torch import flight, waiter
from gputrace.collectors.torch.comm_args import (
    _SPECS,
    _c10d,
    _extractor,
    _group_json,
    _nb,
    _peers,
)
from gputrace.collectors.torch.guard import _hook_failed

_native_tid = threading.get_native_id


class _Local(threading.local):
    busy = False          # inside a recorded collective, or a DDP comm hook
    ctx: Any = None       # the FSDP unit issuing collectives on this thread (torch_fsdp)
    prefetch = False      # that unit's all-gather is a prefetch
    pp: Any = None        # a pipeline schedule's step runs: its p2p carry `pp` (pipeline)
    pp_ranks: Any = None  # and the pipeline group's ranks: its collectives on it carry `pp`
    dtensor = False       # a DTensor redistribution runs (dtensor)


TLS = _Local()


def with_tls(orig: Any, attr: str, value: Any) -> Any:
    """`orig` run with TLS.<attr> set to `value` (the previous value back after it)."""

    @functools.wraps(orig)
    def run(*a: Any, **k: Any) -> Any:
        prev = getattr(TLS, attr)
        setattr(TLS, attr, value)
        try:
            return orig(*a, **k)
        finally:
            setattr(TLS, attr, prev)

    run._gputrace_orig = orig  # type: ignore[attr-defined]
    return run


def _no_state() -> Any:
    return None


_state: Callable[[], Any] = _no_state
_updating = [0]          # inside optimizer.step()
_pending: dict[int, _Entry] = {}
_lock = threading.Lock()
_installed = False
_Work: list[Any] = [type(None)]


def ddp_hook_enter() -> bool:
    """DistributedDataParallel's comm hook is running on this thread: its collectives are
    the bucket's, timed by the hook's wrapper. Returns the previous value for `ddp_hook_exit`."""
    prev = TLS.busy
    TLS.busy = True
    return prev


def ddp_hook_exit(prev: bool) -> None:
    TLS.busy = prev


_ranks_of: dict[int, tuple[int, ...]] = {}


def _on_pipeline(group: Any) -> bool:
    """Whether a collective's group is the running pipeline's own group (TLS.pp_ranks: a
    DeepSpeed pipeline's loss broadcast, its gradient-norm all-reduce across stages)."""
    want = TLS.pp_ranks
    if want is None:
        return False
    c10d = _c10d[0]
    g = group if group is not None else c10d._world.default_pg
    got = _ranks_of.get(id(g))
    if got is None:
        got = _ranks_of[id(g)] = tuple(c10d.get_process_group_ranks(g))
    return got == want


def _phase(st: Any) -> str:
    """The phase open when the call was issued: the torch collector's depths (`bwd_depth`
    inside backward, `depth` inside the outermost forward), then optimizer.step()."""
    try:
        if st.bwd_depth > 0:
            return "backward"
        if st.depth > 0:
            return "forward"
    except AttributeError:   # a collector without these depths: forward/backward unknown
        pass
    return "update" if _updating[0] > 0 else "none"


# -- records --------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("rec", "kind", "t0", "tid", "step", "layer", "nin", "head", "out", "ws",
                 "we", "waiting", "done", "emitted", "flight")

    def __init__(self, rec: Any, kind: str, t0: int, tid: int, step: int, layer: int,
                 nin: int, head: str) -> None:
        self.rec, self.kind, self.t0, self.tid, self.step = rec, kind, t0, tid, step
        self.layer, self.nin, self.head = layer, nin, head
        self.out: set[int] = set()   # its works still running (ids)
        self.ws = self.we = 0        # the job's wait on it: first start, last end
        self.waiting = 0             # waits in progress
        self.done = 0                # when its last future completed
        self.emitted = False
        self.flight: Any = None      # its flight.enter token

    def emit(self, end: int, wait: bool) -> None:
        flight.leave(self.flight, end)
        args = self.head + (f',"wait":[{self.ws},{self.we}]}}' if wait else "}")
        self.rec.span("comm", self.kind, self.t0, end, layer=self.layer, nbytes=self.nin,
                      args=args, step=self.step, tid=self.tid)


def _record(st: Any, kind: str, a: tuple[Any, ...], k: dict[str, Any], ex: Any,
            t0: int, t1: int, res: Any, tok: Any = None) -> None:
    rec = st.rec
    if rec.rank_source is not None:   # the group exists: this process's rank, at once
        rec.learn_rank()
    if kind == "batch":
        ops = a[0] if a else k.get("p2p_op_list") or []
        kind = "send_recv"
        nin = sum(_nb(op.tensor) for op in ops if _is_send(op.op))
        nout = sum(_nb(op.tensor) for op in ops if not _is_send(op.op))
        group = ops[0].group if ops else None
        more = f',"ops":{len(ops)}'   # one record, this many sends and receives
    else:
        nin = ex[0](a, k)
        nout = ex[1](a, k)
        group = ex[2](a, k)
        more = ""
    works = _works(res) if res is not None else ()
    ctx = TLS.ctx
    layer, fsdp = (-1, "") if ctx is None or nin < getattr(ctx, "min_bytes", 0) \
        else ctx.for_kind(kind)
    phase = _phase(st)
    if phase == "none" and '"role":"unshard"' in fsdp:
        phase = "forward"   # the root's FSDP pre-forward, run before the model's forward hook
    pp = TLS.pp
    if pp is not None and (kind == "send_recv" or _on_pipeline(group)):   # between stages
        fsdp += pp
    if kind == "all_to_all":                     # the bytes this rank sends each peer
        fsdp += _peers(a, k)
    head = (f'{{"kind":"{kind}","bytes_out":{nout},"group":{_group_json(group)},'
            f'"async":{"true" if works else "false"},"phase":"{phase}"{fsdp}{more}')
    if not works:    # on this thread (the recorder notes it): GPU launches inside are comm
        flight.leave(tok, t1)
        rec.span("comm", kind, t0, t1, layer=layer, nbytes=nin, args=head + "}")
        return
    tid = _native_tid()
    if tid not in rec.threads:
        rec._new_thread(tid)
    e = _Entry(rec, kind, t0, tid, rec.step, layer, nin, head)
    e.flight = tok
    with _lock:
        for w in works:
            _pending[id(w)] = e
            e.out.add(id(w))
    cpu = _on_cpu(a, k)
    for w in works:
        try:
            fut, done = w.get_future(), functools.partial(_completed, e, w)
            if cpu:   # on a thread of gputrace's, not the backend's (collectors.torch.waiter)
                waiter.when_done(fut, done)
            else:     # NCCL: on the issuing thread when it completes
                fut.add_done_callback(done)
        except Exception:  # noqa: BLE001 - no future: a backend's own Work ends at its wait(),
            if type(w) is not _Work[0]:  # any other (a coalesced call's) at the call's end
                _finish(e, w, t1, False)


def _on_cpu(a: tuple[Any, ...], k: dict[str, Any]) -> bool:
    """Whether the call's first tensor (or its first op's) is on the CPU."""
    for x in (*a, *k.values()):
        if isinstance(x, (list, tuple)) and x:
            x = x[0]
        x = getattr(x, "tensor", x)       # a P2POp
        if hasattr(x, "device"):
            return waiter.on_cpu(x)
    return False


def _is_send(op: Any) -> bool:
    return getattr(op, "__name__", "") == "isend"


def _works(res: Any) -> list[Any]:
    Work = _Work[0]
    if isinstance(res, Work):
        return [res]
    if isinstance(res, list) and res and all(isinstance(w, Work) for w in res):
        return res
    return []


def _finish(e: _Entry, w: Any, t: int, waited: bool) -> None:
    """Work w of entry e completed at t: its future did, or (`waited`) the job's wait() on
    it returned. The entry is written once all its works completed and no wait is open."""
    with _lock:
        if _pending.get(id(w)) is e:
            del _pending[id(w)]
        e.out.discard(id(w))
        if waited:
            e.waiting -= 1
            e.we = t
        else:
            e.done = max(e.done, t)
        if e.emitted or e.out or e.waiting:
            return
        e.emitted = True
    end = min(e.done, e.we) if e.done and e.we else (e.done or e.we)
    # a wait that began after the completion (its callback came late) hid nothing
    e.emit(end, e.ws > 0 and not (e.done and e.done <= e.ws))


def _completed(e: _Entry, w: Any, fut: Any) -> None:
    try:
        _finish(e, w, _state_now(), False)
    except Exception as x:  # noqa: BLE001
        _hook_failed("collective completion", x)


def _state_now() -> int:
    st = _state()
    return st.now() if st is not None else 0


# -- patches --------------------------------------------------------------------------------
def _wrap(name: str, orig: Any) -> Any:
    spec = _SPECS.get(name)
    kind = spec[0] if spec else "batch"
    ex = (_extractor(spec[1], True), _extractor(spec[2], True),
          _extractor(spec[3], False)) if spec else ()
    tls = TLS
    seq = kind not in flight.P2P

    @functools.wraps(orig)
    def collective(*a: Any, **k: Any) -> Any:
        if tls.busy:   # inside another's (a DDP comm hook's): the bucket's span, no record
            with waiter.issuing(lambda: _on_cpu(a, k)):
                return orig(*a, **k)
        st = _state()
        if st is None:
            return orig(*a, **k)
        now = st.now
        t0 = now()
        tok = None
        if seq:   # its place in its group's sequence, seen at once (a hang's evidence)
            try:
                tok = flight.enter(st.rec, kind, ex[2](a, k), t0)
            except Exception as e:  # noqa: BLE001
                _hook_failed(f"torch.distributed.{name} (entry)", e)
        tls.busy = True
        try:
            with waiter.issuing(lambda: _on_cpu(a, k)):
                res = orig(*a, **k)
        except BaseException:
            flight.leave(tok, now())
            raise
        finally:
            tls.busy = False
        t1 = now()
        try:
            _record(st, kind, a, k, ex, t0, t1, res, tok)
        except Exception as e:  # noqa: BLE001 - the collective ran; only its record is lost
            flight.leave(tok, t1)
            _hook_failed(f"torch.distributed.{name}", e)
        return res

    collective._gputrace_orig = orig  # type: ignore[attr-defined]
    return collective


def _patch_wait() -> None:
    from torch.distributed import Work

    _Work[0] = Work
    orig = Work.wait
    if getattr(orig, "_gputrace_orig", None) is not None:
        return

    @functools.wraps(orig)
    def wait(self: Any, *a: Any, **k: Any) -> Any:
        e = _pending.get(id(self)) if _pending else None
        if e is None or e.emitted:
            return orig(self, *a, **k)
        try:
            ws = _state_now()
            with _lock:
                e.ws = e.ws or ws
                e.waiting += 1
        except Exception as x:  # noqa: BLE001
            _hook_failed("Work.wait", x)
            return orig(self, *a, **k)
        try:
            return orig(self, *a, **k)
        finally:
            try:
                _finish(e, self, _state_now(), True)
            except Exception as x:  # noqa: BLE001
                _hook_failed("Work.wait", x)

    wait._gputrace_orig = orig  # type: ignore[attr-defined]
    Work.wait = wait


def install(state: Callable[[], Any]) -> bool:
    """Patch the collectives once per process; `state()` is the torch collector's state
    (its recorder, clock and phase depths), None while nothing records. True where this
    call patched them (torch.distributed is there): the collectors of what is built on
    them (FSDP, DeepSpeed, pipelining, meshes, DTensor) are then installed by the caller."""
    global _state, _installed
    _state = state
    if _installed:
        return False
    _installed = True
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - a torch built without distributed
        return False
    if not dist.is_available():
        return False
    _c10d[0] = c10d
    try:
        for name in (*_SPECS, "batch_isend_irecv"):
            orig = getattr(c10d, name, None)
            if orig is None or getattr(orig, "_gputrace_orig", None) is not None:
                continue
            w = _wrap(name, orig)
            setattr(c10d, name, w)
            if getattr(dist, name, None) is orig:
                setattr(dist, name, w)
        _patch_wait()
        _patch_optimizer()
    except Exception as e:  # noqa: BLE001
        _hook_failed("torch.distributed collectives", e)
    return True


def _patch_optimizer() -> None:
    from torch.optim import optimizer as optim_module

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        _updating[0] += 1

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        _updating[0] = max(_updating[0] - 1, 0)

    optim_module.register_optimizer_step_pre_hook(pre)
    optim_module.register_optimizer_step_post_hook(post)
