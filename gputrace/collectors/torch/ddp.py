"""DistributedDataParallel's gradient buckets: a comm span per bucket, timed by wrapping its
comm hook (the default all-reduce, or the job's own)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import torch

from gputrace.collectors.torch import flight, waiter
from gputrace.collectors.torch.comm import ddp_hook_enter, ddp_hook_exit
from gputrace.collectors.torch.guard import _hook_failed


def maybe_hook_ddp(self: Any, module: torch.nn.Module) -> None:
    """At a DDP module's first forward (or a compiled one's): time its buckets with the default all-reduce
    hook unless the job registered its own (wrapped when it was registered)."""
    ddp = _ddp_class()
    # torch.compile(DDP(model)), as torch.compile's docs write it: the DDP module inside
    # (DDPOptimizer splits the graph at its buckets; the reducer still calls the comm hook)
    while not isinstance(module, ddp) if ddp is not None else False:
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return
        module = inner
    if ddp is None or not isinstance(module, ddp) or id(module) in self.ddp_hooked:
        return
    self.ddp_hooked.add(id(module))
    if getattr(module, "_use_python_reducer", False):
        # compiled autograd's DDP: no buckets, a functional all-reduce per gradient traced
        # into the compiled backward (a comm hook there gets (grad, param), not a bucket)
        self.note("DDP under compiled autograd (python reducer): its all-reduces run inside "
                  "the compiled backward, where gputrace's Python hooks do not see them (on "
                  "a GPU, CUPTI records their NCCL kernels)")
        return
    if getattr(module, "_gputrace_hook", None) is not None:
        return  # the user's own hook is already wrapped
    if getattr(module, "_gputrace_builtin", False):
        self.note("DDP uses a builtin comm hook: buckets not timed")
        return
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    _orig_register_comm_hook(module, module.process_group, timed_hook(self, allreduce_hook))
    module._gputrace_hook = allreduce_hook


# Buckets are rebuilt in gradient order once, after the first backward: what a bucket holds
# is looked up again while the steps are young, then kept by its index and size.
_SETTLED_STEP = 3


def timed_hook(self: Any, hook: Any) -> Any:
    """The comm hook `hook`, timed: a comm span per bucket when its future completes.

    torch's default `allreduce_hook` is run as the same three calls (divide by the group's
    size, all-reduce asynchronously, the reduced buffer as the result) with the span taken
    in the one callback, not a second; what a bucket holds is found once, not per call."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rec = self.rec
    now = self.now
    param_layer = self.param_layer
    known: dict[tuple[int, int], tuple[int, str]] = {}
    own = hook is allreduce_hook

    def bucket_of(bucket: Any, buf: Any) -> tuple[int, int, str]:
        index = bucket.index()
        key = (index, buf.numel())
        got = known.get(key)
        if got is None:
            layers = sorted({param_layer.get(id(p), -1) for p in bucket.parameters()} - {-1})
            got = (key[1] * buf.element_size(),
                   json.dumps({"layers": layers}, separators=(",", ":")))
            if rec.step >= _SETTLED_STEP:
                known[key] = got
        return (index, *got)

    @functools.wraps(hook)
    def timed(state: Any, bucket: Any) -> Any:
        t0 = now()
        try:
            buf = bucket.buffer()
            index, nbytes, args = bucket_of(bucket, buf)
        except Exception as e:  # noqa: BLE001 - the bucket goes untimed, not unsent
            _hook_failed("the DDP comm hook", e)
            return hook(state, bucket)
        step = rec.step
        tok = None
        cpu = waiter.on_cpu(buf)
        prev = ddp_hook_enter()   # the bucket's collectives are this span, not their own
        try:
            if own:
                group = state if state is not None else dist.group.WORLD
                try:
                    tok = flight.enter(rec, "all_reduce", group, t0)
                except Exception as e:  # noqa: BLE001
                    _hook_failed("the DDP comm hook (entry)", e)
                buf.div_(group.size())
                # gloo: issued without the backward's Python context (collectors.torch.waiter)
                with waiter.issuing(lambda: cpu):
                    work = _all_reduce(dist)(buf, group=group, async_op=True)
                fut = work.get_future()
            else:   # the job's hook: its own collectives pass through collectors.torch.comm
                fut = hook(state, bucket)
        finally:
            ddp_hook_exit(prev)

        def record() -> None:
            t1 = now()
            flight.leave(tok, t1)
            rec.span("comm", "allreduce", t0, t1, layer=index, nbytes=nbytes, args=args,
                     step=step)

        def value(f: Any) -> Any:
            return f.value()[0] if own else f.value()

        def done(f: Any) -> Any:
            record()
            return value(f)

        if not cpu:    # NCCL: then() runs on the issuing thread
            return fut.then(done)
        # gloo: not a then() on gloo's thread (collectors.torch.waiter), the bucket's result
        # handed to the reducer by a thread of gputrace's once the all-reduce completed
        out = torch.futures.Future()

        def settle(f: Any) -> None:
            try:
                v = value(f)
            except Exception as e:  # noqa: BLE001 - the all-reduce's own failure, the job's
                out.set_exception(e)
                return
            try:
                record()
            except Exception as e:  # noqa: BLE001 - the bucket goes unrecorded, not unsent
                _hook_failed("the DDP comm hook (completion)", e)
            out.set_result(v)

        waiter.when_done(fut, settle)
        return out

    return timed


def _all_reduce(dist: Any) -> Any:
    """torch.distributed.all_reduce as torch made it (gputrace's timing wrapper would only
    pass the bucket's call through)."""
    f = dist.all_reduce
    return getattr(f, "_gputrace_orig", f)


def _ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:
        return None
    return DistributedDataParallel


_orig_register_comm_hook: Any = None


def patch_ddp(current_state: Callable[[], Any]) -> None:
    global _orig_register_comm_hook
    ddp = _ddp_class()
    if ddp is None or _orig_register_comm_hook is not None:
        return
    _orig_register_comm_hook = ddp.register_comm_hook
    orig_builtin = ddp._register_builtin_comm_hook

    def register_comm_hook(self: Any, state_: object, hook: Any) -> None:
        s = current_state()
        _orig_register_comm_hook(self, state_, timed_hook(s, hook) if s else hook)
        self._gputrace_hook = hook

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self._gputrace_builtin = True
        orig_builtin(self, comm_hook_type)

    ddp.register_comm_hook = register_comm_hook
    ddp._register_builtin_comm_hook = _register_builtin_comm_hook
