"""PyTorch auto-instrumentation: the paper's phases from an unchanged training script.

Installed by the `record` bootstrap right after the job imports torch (or by
`gputrace.torch.instrument` in a harness). It uses only cheap, global hooks:

- iteration: iterations tile the loop. With a DataLoader one begins when the loop asks for
  the batch that follows an optimizer step; without one, where the previous one ended (the
  optimizer step's end); the first begins at the loop's first batch request or forward.
  Several forward/backward passes per optimizer step (gradient accumulation) are one
  iteration. A batch that only runs forward (evaluation) is an `inference` iteration. A loop
  that never calls an optimizer has an iteration per forward/backward pass.
- update: global optimizer step pre/post hooks (any loop shape);
- io: the wait in `DataLoader.__next__` on the loop's thread (exposed I/O), and each batch's
  fetch in the loader's workers (total I/O work);
- forward: global module forward pre/post hooks; a span per module that owns parameters,
  `layer` 1..L in execution order from the input side, plus one span for the outermost call,
  and one (`loss`) from the last outermost call's end to the backward (the loss computed
  outside the model is part of the forward pass);
- backward: `torch.autograd.backward` entry/exit, and per layer the end of its last
  parameter's gradient accumulation (post-accumulate-grad hooks), with `bytes` = the bytes
  of the gradients the layer produces (what its all-reduce would move; replay uses it);
- comm: every DistributedDataParallel bucket, timed by wrapping its comm hook (the default
  all-reduce, or the user's own): `layer` = bucket index, `bytes`, `args.layers`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from gputrace.collectors import instrumentation_failed
from gputrace.recorder import Recorder

_installed: _State | None = None
_failed: list[str] = []


def _guarded(hook: Any) -> Any:
    """A hook whose own failure is one line on stderr, not the training's exception. One
    wrapper per arity: no argument tuple is built on the hot path."""
    name = hook.__name__
    n = hook.__code__.co_argcount

    def fail(e: Exception) -> None:
        _hook_failed(name, e)

    if n == 1:
        def guarded(a: Any) -> Any:
            try:
                return hook(a)
            except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
                fail(e)
    elif n == 2:
        def guarded(a: Any, b: Any) -> Any:  # type: ignore[misc]
            try:
                return hook(a, b)
            except Exception as e:  # noqa: BLE001
                fail(e)
    elif n == 3:
        def guarded(a: Any, b: Any, c: Any) -> Any:  # type: ignore[misc]
            try:
                return hook(a, b, c)
            except Exception as e:  # noqa: BLE001
                fail(e)
    elif n == 4:
        def guarded(a: Any, b: Any, c: Any, d: Any) -> Any:  # type: ignore[misc]
            try:
                return hook(a, b, c, d)
            except Exception as e:  # noqa: BLE001
                fail(e)
    else:
        def guarded(*args: Any) -> Any:  # type: ignore[misc]
            try:
                return hook(*args)
            except Exception as e:  # noqa: BLE001
                fail(e)
    return functools.wraps(hook)(guarded)


def _hook_failed(where: str, e: Exception) -> None:
    instrumentation_failed("torch", "torch", where, e, _failed,
                           _installed.rec if _installed is not None else None)


class _State:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.now = rec.clock.now_ns
        self.layer_of: dict[int, int] = {}        # id(module) -> layer (0: owns no params)
        self.param_layer: dict[int, int] = {}     # id(param) -> layer
        self.layer_nparams: dict[int, int] = {}   # layer -> params that get gradients
        self.layer_grad_bytes: dict[int, int] = {}  # layer -> bytes of those gradients
        self.layer_names: dict[int, str] = {}
        self.next_layer = 1
        self.fwd_t0: dict[int, list[int]] = {}
        self.depth = 0
        self.root_t0 = 0
        self.root_name = ""
        self.bwd_depth = 0
        self.bwd_t0 = 0
        self.last_mark = 0                        # end of the last finished layer backward
        self.grad_count: dict[int, int] = {}
        self.grad_last: dict[int, int] = {}
        self.update_t0 = 0
        self.last_bwd_end = 0
        self.last_fwd_end = 0                     # end of the last outermost forward
        self.loss_from = 0                        # a forward ended since the last backward
        self.its = _Iterations(rec)
        self.ddp_hooked: set[int] = set()
        self.notes: list[str] = []
        self.lock = threading.Lock()

    # -- forward -------------------------------------------------------------------------
    def layer_for(self, module: torch.nn.Module) -> int:
        key = id(module)
        layer = self.layer_of.get(key)
        if layer is not None:
            return layer
        params = [p for p in module._parameters.values() if p is not None]
        if not params:
            self.layer_of[key] = 0
            return 0
        with self.lock:
            layer = self.next_layer
            self.next_layer += 1
        self.layer_of[key] = layer
        self.layer_names[layer] = type(module).__name__
        grads = nbytes = 0
        for p in params:
            self.param_layer[id(p)] = layer
            if p.requires_grad and p.is_leaf:   # a non-leaf (functional_call) has no .grad
                grads += 1
                nbytes += p.numel() * p.element_size()
                p.register_post_accumulate_grad_hook(self.grad_ready)
        self.layer_nparams[layer] = grads
        self.layer_grad_bytes[layer] = nbytes
        return layer

    @_guarded
    def forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        t = self.now()
        if self.depth == 0:
            self.its.forward(t, torch.is_grad_enabled())
            self.root_t0 = t
            self.root_name = type(module).__name__
            self._maybe_hook_ddp(module)
        self.depth += 1
        if self.layer_for(module):
            self.fwd_t0.setdefault(id(module), []).append(t)

    @_guarded
    def forward_post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        t = self.now()
        layer = self.layer_of.get(id(module), 0)
        if layer:
            starts = self.fwd_t0.get(id(module))
            if starts:
                self.rec.span("forward", self.layer_names[layer], starts.pop(), t, layer=layer)
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self.rec.span("forward", self.root_name, self.root_t0, t)
            self.last_fwd_end = self.loss_from = t

    # -- backward ------------------------------------------------------------------------
    @_guarded
    def grad_ready(self, param: torch.Tensor) -> None:
        t = self.now()
        layer = self.param_layer.get(id(param))
        if layer is None:
            return
        with self.lock:
            n = self.grad_count.get(layer, 0) + 1
            self.grad_count[layer] = n
            self.grad_last[layer] = t
            if n < self.layer_nparams.get(layer, 1):
                return
            start = self.last_mark or self.bwd_t0 or t
            self.last_mark = t
            del self.grad_count[layer]
        self.rec.span("backward", self.layer_names.get(layer, "layer"), start, t, layer=layer,
                      nbytes=self.layer_grad_bytes.get(layer))

    @_guarded
    def backward_enter(self) -> None:
        if self.bwd_depth == 0:
            self.bwd_t0 = self.last_mark = t = self.now()
            if self.loss_from and self.depth == 0:
                # the loss (and its scaling) between the model's forward and this backward
                self.rec.span("forward", "loss", self.loss_from, t)
            self.loss_from = 0
            self.its.backward()
        self.bwd_depth += 1

    @_guarded
    def backward_exit(self) -> None:
        self.bwd_depth -= 1
        if self.bwd_depth:
            return
        t = self.now()
        with self.lock:
            partial = [(ly, self.grad_last[ly]) for ly in self.grad_count]
            self.grad_count.clear()
            start = self.last_mark
        for layer, end in sorted(partial, key=lambda x: x[1]):  # layers with unused params
            self.rec.span("backward", self.layer_names.get(layer, "layer"), start, end,
                          layer=layer, nbytes=self.layer_grad_bytes.get(layer))
            start = end
        self.rec.span("backward", "backward", self.bwd_t0, t)
        self.last_bwd_end = self.its.last_bwd = t
        self.last_mark = 0

    # -- update --------------------------------------------------------------------------
    @_guarded
    def step_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.update_t0 = self.now()

    @_guarded
    def step_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        t = self.now()
        # With a closure, forward and backward run inside step(): update starts after them.
        start = max(self.update_t0, self.last_bwd_end if self.last_bwd_end <= t else 0)
        self.rec.span("update", type(opt).__name__, start, t)
        self.loss_from = 0
        self.its.stepped(t)

    # -- DDP communication ---------------------------------------------------------------
    def _maybe_hook_ddp(self, module: torch.nn.Module) -> None:
        ddp = _ddp_class()
        if ddp is None or not isinstance(module, ddp) or id(module) in self.ddp_hooked:
            return
        self.ddp_hooked.add(id(module))
        if getattr(module, "_gputrace_hook", None) is not None:
            return  # the user's own hook is already wrapped
        if getattr(module, "_gputrace_builtin", False):
            self.notes.append("DDP uses a builtin comm hook: buckets not timed")
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        _orig_register_comm_hook(module, module.process_group, self.timed_hook(allreduce_hook))
        module._gputrace_hook = allreduce_hook

    def timed_hook(self, hook: Any) -> Any:
        rec = self.rec
        now = self.now
        param_layer = self.param_layer

        @functools.wraps(hook)
        def timed(state: Any, bucket: Any) -> Any:
            t0 = now()
            try:
                buf = bucket.buffer()
                nbytes = buf.numel() * buf.element_size()
                layers = sorted({param_layer.get(id(p), -1) for p in bucket.parameters()}
                                - {-1})
                index = bucket.index()
            except Exception as e:  # noqa: BLE001 - the bucket goes untimed, not unsent
                _hook_failed("the DDP comm hook", e)
                return hook(state, bucket)
            step = rec.step
            fut = hook(state, bucket)

            def done(f: Any) -> Any:
                rec.span("comm", "allreduce", t0, now(), layer=index, nbytes=nbytes,
                         args={"layers": layers}, step=step)
                return f.value()

            return fut.then(done)

        return timed


class _Iterations:
    """Where the loop's iterations begin and end, from what the hooks see: batch requests,
    outermost forwards (with or without grad), backward passes and optimizer steps.

    A micro-batch is what runs between two boundaries (batch requests; without a loader,
    outermost forwards). An iteration ends with the micro-batch whose optimizer step ran
    (at the next batch request with a loader, so the logging after the step belongs to it;
    at the step's end without one). Until the first optimizer step it is not known whether
    one will come: the boundaries seen so far wait, and become one iteration (accumulation)
    at the first step, or one iteration each (a loop with no optimizer) when the run ends."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.loader = False          # the loop asks a DataLoader for batches
        self.seen_step = False       # an optimizer step ran in this process
        self.pending: list[int] = []  # boundaries before the first step
        self.last_bwd = 0
        self._reset()
        rec.close_hooks.append(self.finish)

    def _reset(self) -> None:
        self.fwd = self.grad_fwd = self.bwd = self.step = False   # in this micro-batch
        self.step_end = 0

    def _boundary(self, t: int) -> None:
        """A micro-batch ends at t; what it ran decides whether an iteration ends too."""
        rec = self.rec
        if rec._iter_start is None:
            rec.open_iteration(t)
        elif self.step:          # (with a loader: without one the step closed it)
            rec.close_iteration(t, reopen=True)
        elif self.fwd and not self.bwd and not self.grad_fwd:
            # forward only, without grad: an evaluation batch, not a training iteration
            self._flush_pending()
            rec.close_iteration(t, name="inference", reopen=True)
        elif self.bwd and not self.seen_step:
            self.pending.append(t)
        else:
            return      # accumulating gradients, or nothing ran: the micro-batch goes on
        self._reset()

    def _flush_pending(self) -> None:
        """No optimizer step came: every waiting boundary ends an iteration of its own."""
        rec = self.rec
        for b in self.pending:
            if rec._iter_start is not None and b > rec._iter_start:
                rec.close_iteration(b, reopen=True)
        self.pending = []

    def batch(self, t: int) -> None:
        self.loader = True
        self._boundary(t)

    def exhausted(self) -> None:
        """The loader ran out: an iteration opened by that request, with nothing in it,
        is none (the next epoch's first request opens the next)."""
        if self.rec._iter_start is not None and not self.rec._iter_live:
            self.rec.drop_iteration()

    def forward(self, t: int, grad: bool) -> None:
        if self.rec._iter_start is None:
            self.rec.open_iteration(t)
        elif not self.loader and self.bwd and not self.seen_step:
            # without a loader (and no optimizer yet) a forward after a backward begins a
            # micro-batch: a boundary that the first step, or the run's end, settles
            self._boundary(t)
        self.fwd = True
        self.grad_fwd = self.grad_fwd or grad

    def backward(self) -> None:
        self.bwd = True

    def stepped(self, t: int) -> None:
        if not self.seen_step:
            self.seen_step = True
            self.pending = []    # the passes before the first step accumulated into it
        self.step = True
        self.step_end = t
        if self.rec._iter_start is None:
            self.rec.open_iteration(t)
        if not self.loader:
            self.rec.close_iteration(t, reopen=True)
            self._reset()

    def finish(self, t: int) -> None:
        rec = self.rec
        if rec._iter_start is None:
            return
        if self.step and self.loader:
            rec.close_iteration(self.step_end)
        elif self.pending or (self.bwd and not self.seen_step):
            self._flush_pending()
            rec.close_iteration(self.last_bwd or t)
        rec.drop_iteration()   # what follows the last step is no iteration


def _ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:
        return None
    return DistributedDataParallel


_orig_register_comm_hook: Any = None


def _patch_ddp(state: _State) -> None:
    global _orig_register_comm_hook
    ddp = _ddp_class()
    if ddp is None or _orig_register_comm_hook is not None:
        return
    _orig_register_comm_hook = ddp.register_comm_hook
    orig_builtin = ddp._register_builtin_comm_hook

    def register_comm_hook(self: Any, state_: object, hook: Any) -> None:
        s = _installed
        _orig_register_comm_hook(self, state_, s.timed_hook(hook) if s else hook)
        self._gputrace_hook = hook

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self._gputrace_builtin = True
        orig_builtin(self, comm_hook_type)

    ddp.register_comm_hook = register_comm_hook
    ddp._register_builtin_comm_hook = _register_builtin_comm_hook


def _patch_dataloader(state: _State) -> None:
    import torch.utils.data._utils.fetch as fetch
    import torch.utils.data.dataloader as dl

    now = state.now
    orig_next = dl._BaseDataLoaderIter.__next__

    @_guarded
    def batch(t: int) -> None:
        state.its.batch(t)

    @_guarded
    def exhausted() -> None:
        state.its.exhausted()

    def __next__(self: Any) -> Any:
        t0 = now()
        batch(t0)
        try:
            out = orig_next(self)
        except StopIteration:
            exhausted()
            raise
        state.rec.span("io", "DataLoader.__next__", t0, now())
        return out

    dl._BaseDataLoaderIter.__next__ = __next__

    for cls in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher):
        orig_fetch = cls.fetch

        def fetch_(self: Any, index: Any, _orig: Any = orig_fetch) -> Any:
            t0 = now()
            try:
                return _orig(self, index)
            finally:
                r = _current_rec()
                if r is not None:
                    r.span("io", "fetch", t0, r.clock.now_ns(), step=-1)

        cls.fetch = fetch_


def _current_rec() -> Recorder | None:
    from gputrace.recorder import current

    return current()


def _patch_backward(state: _State) -> None:
    orig = torch.autograd.backward

    @functools.wraps(orig)
    def backward(*args: Any, **kwargs: Any) -> Any:
        state.backward_enter()
        try:
            return orig(*args, **kwargs)
        finally:
            state.backward_exit()

    torch.autograd.backward = backward


def auto_instrument(rec: Recorder) -> str:
    """Install the hooks once per process; returns the collector status line."""
    global _installed
    if _installed is not None:
        if _installed.rec is not rec:
            _installed.rec = rec
            _installed.now = rec.clock.now_ns
            _installed.its = _Iterations(rec)
        return "ok"
    state = _State(rec)
    _installed = state
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    nn_module.register_module_forward_pre_hook(state.forward_pre)
    nn_module.register_module_forward_hook(state.forward_post)
    optim_module.register_optimizer_step_pre_hook(state.step_pre)
    optim_module.register_optimizer_step_post_hook(state.step_post)
    _patch_backward(state)
    _patch_dataloader(state)
    _patch_ddp(state)
    rec.metadata.setdefault("software", {})["torch"] = torch.__version__
    rec.metadata["torch"] = {"cuda": bool(torch.cuda.is_available())}
    return "ok"


