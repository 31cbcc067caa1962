"""PyTorch auto-instrumentation: the paper's phases from an unchanged training script.

Installed by the `record` bootstrap right after the job imports torch (or by
`gputrace.torch.instrument` in a harness). It uses only cheap hooks, none that puts every
module call on torch's hooked path:

- iteration: iterations tile the loop. With a DataLoader one begins when the loop asks for
  the batch that follows an optimizer step; without one, where the previous one ended (the
  optimizer step's end); the first begins at the loop's first batch request or forward.
  Several forward/backward passes per optimizer step (gradient accumulation) are one
  iteration. A batch that only runs forward (evaluation) is an `inference` iteration. A loop
  that never calls an optimizer has an iteration per forward/backward pass.
- update: global optimizer step pre/post hooks (any loop shape);
- io: the wait in `DataLoader.__next__` on the loop's thread (exposed I/O), and each batch's
  fetch in the loader's workers (total I/O work);
- forward: forward pre/post hooks on each model's root (found as the model is built, see
  collectors.torch.modules): one span for the outermost call, and one (`loss`) from the last outermost
  call's end to the backward (the loss computed outside the model is part of the forward
  pass); the modules `GPUTRACE_LAYERS` chooses (blocks, leaves, off) are numbered `layer`
  1..L in execution order from the input side at their first call, and get a forward span
  per call only with `GPUTRACE_LAYER_FORWARD=1`;
- backward: `torch.autograd.backward` entry/exit, and per timed layer the end of its last
  parameter's gradient accumulation (collectors.torch.grads: one post-accumulate-grad hook per layer),
  with `bytes` = the bytes of the gradients the layer produces (what its all-reduce would move; replay uses it);
- comm: every DistributedDataParallel bucket, timed by wrapping its comm hook (the default
  all-reduce, or the user's own): `layer` = bucket index, `bytes`, `args.layers`.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import torch

from gputrace.collectors.torch import checkpoint as torch_checkpoint
from gputrace.collectors.torch import comm as torch_comm
from gputrace.collectors.torch import framework_saves as torch_framework_saves
from gputrace.collectors.torch import guard as torch_guard
from gputrace.collectors.torch import hf_trainer as torch_hf_trainer
from gputrace.collectors.torch import lightning as torch_lightning
from gputrace.collectors.torch import startup as torch_startup
from gputrace.collectors.torch.batch import BatchOnce, describe
from gputrace.collectors.torch.dataloader import patch_dataloader
from gputrace.collectors.torch.ddp import maybe_hook_ddp, patch_ddp
from gputrace.collectors.torch.grads import _begin, _LayerGrads, _settle
from gputrace.collectors.torch.guard import _guarded
from gputrace.collectors.torch.iterations import _Iterations, optimizer_made
from gputrace.collectors.torch.modules import Modules, env_forward, env_mode
from gputrace.collectors.torch.rank import learn_rank_from_torch
from gputrace.collectors.torch.recompute import in_backward
from gputrace.recorder.core import Recorder

_installed: _State | None = None


class _State:
    def __init__(self, rec: Recorder, layers: str = "blocks", forward: bool = False) -> None:
        self.rec = rec
        self.now = rec.clock.now_ns
        self.push = rec.push_perf                 # a span timed with perf_counter_ns
        self.layer_of: dict[int, int] = {}        # id(module) -> layer (0: owns no params)
        self.param_layer: dict[int, int] = {}     # id(param) -> layer
        self.layer_nparams: dict[int, int] = {}   # layer -> params that get gradients
        self.layer_grad_bytes: dict[int, int] = {}  # layer -> bytes of those gradients
        self.layer_names: dict[int, str] = {}
        self.next_layer = 1
        self.depth = 0                            # > 0 inside the outermost forward
        self.root_t0 = 0
        self.root_name = ""
        self.bwd_depth = 0                        # > 0 inside torch.autograd.backward
        self.bwd_t0 = 0
        self.last_mark = 0                        # end of the last finished layer backward
        self.grads: dict[int, _LayerGrads] = {}   # layer -> its gradients' hook
        self.probing: set[_LayerGrads] = set()    # layers learning their last gradient
        self.off = rec.clock.from_perf(0)         # perf_counter_ns -> trace clock
        self.update_t0 = 0
        self.engine_steps = 0                     # > 0 inside a training engine's step
        self.last_bwd_end = 0
        self.last_fwd_end = 0                     # end of the last outermost forward
        self.loss_from = 0                        # a forward ended since the last backward
        self.its = _Iterations(rec)
        self.ddp_hooked: set[int] = set()
        self.notes: list[str] = []
        self.lock = threading.Lock()
        self.modules = Modules(self, layers, forward)
        self.adopted = False                      # the live models were looked for once
        self.batch: dict | None = None            # the model's input, described once (batch)
        self.root_ran = False                     # a root's forward since the last backward
        self.pipeline_steps = 0                   # > 0 inside a pipeline schedule's step

    def mem(self, phase: str, end: int, t: int) -> None:
        """The memory at a phase's start (end=0) or end (collectors.memory): read inside the
        phase, after its start is taken and before its end, so that nothing of ours runs
        between the phase's edge and the job's own code (a read there gave the writer
        thread a moment to take the GIL: the job's clock and ours then disagreed)."""
        m = self.rec.memory
        # not inside a pipeline schedule's or an engine's step (DeepSpeed's pipeline runs
        # every microbatch there): reads there moved its pipeline term by a sixth
        if m is not None and not self.pipeline_steps and not self.engine_steps:
            m.mark(phase, end, t)

    def note(self, text: str) -> None:
        """Something the analysis should say of this process's recording (in the shard's
        metadata, `torch.notes`), once."""
        if text not in self.notes:
            self.notes.append(text)
            self.rec.metadata.setdefault("torch", {})["notes"] = list(self.notes)

    # -- forward -------------------------------------------------------------------------
    def layer_for(self, module: torch.nn.Module, params: list[Any] | None = None) -> int:
        """The layer of `module` (numbered at first sight, 1..L), its gradients' hooks
        registered: `params` (a block's whole subtree) or the module's own parameters. A
        parameter already in a layer (tied weights) stays in that one. 0: owns none."""
        key = id(module)
        layer = self.layer_of.get(key)
        if layer is not None:
            return layer
        if params is None:
            params = [p for p in module._parameters.values() if p is not None]
        if not params:
            self.layer_of[key] = 0
            return 0
        with self.lock:
            layer = self.layer_of.get(key)
            if layer is not None:
                return layer
            layer = self.next_layer
            self.next_layer += 1
            self.layer_of[key] = layer
        self.layer_names[layer] = type(module).__name__
        hook = self.grads[layer] = _LayerGrads(self, layer, type(module).__name__)
        nbytes = 0
        for p in params:
            if id(p) in self.param_layer:
                continue
            self.param_layer[id(p)] = layer
            if p.requires_grad and p.is_leaf:   # a non-leaf (functional_call) has no .grad
                nbytes += p.numel() * p.element_size()
                hook.add(p)
        self.layer_nparams[layer] = hook.total
        self.layer_grad_bytes[layer] = hook.nbytes = nbytes
        return layer

    @_guarded
    def root_pre(self, module: torch.nn.Module, args: Any) -> None:
        """A model root's forward begins (nested roots only count depth). Run inside the
        backward it is a recompute (the job checkpoints the whole model): no forward, its
        time a `recompute` span (collectors.torch.recompute)."""
        if in_backward():
            return
        t = self.now()
        if self.depth == 0:
            self.mem("forward", 0, t)
            self.root_ran = True
            # a forward in eval mode trains nothing either (evaluation)
            self.its.forward(t, torch.is_grad_enabled() and module.training)
            self.root_t0 = t
            self.root_name = type(module).__name__
            if module not in self.modules.seen:
                maybe_hook_ddp(self, module)
                self.modules.first_forward(module)
                if self.batch is None:
                    self.batch = describe(type(module).__name__, args, {})
                    if self.batch is None:   # keyword inputs: read at the next call
                        once = BatchOnce(self, type(module).__name__)
                        once.handle = module.register_forward_pre_hook(once, with_kwargs=True)
        self.depth += 1

    @_guarded
    def root_post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if in_backward():
            return
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self.mem("forward", 1, self.now())
            t = self.now()
            if self.batch:
                self.rec.span("forward", self.root_name, self.root_t0, t,
                              args={"batch": self.batch})
                self.batch = {}
            else:
                self.rec.span("forward", self.root_name, self.root_t0, t)
            self.last_fwd_end = self.loss_from = t

    # -- backward ------------------------------------------------------------------------
    @_guarded
    def backward_enter(self) -> None:
        if self.bwd_depth == 0:
            self.bwd_t0 = t = self.now()
            self.mem("backward", 0, t)
            if self.probing:
                _begin(self.probing)
            self.last_mark = t - self.off         # layer marks are on perf_counter_ns
            if self.loss_from and self.depth == 0 and not self.pipeline_steps:
                # the loss (and its scaling) between the model's forward and this backward
                self.rec.span("forward", "loss", self.loss_from, t)
            self.loss_from = 0
            self.its.backward()
            if not self.root_ran:
                # a backward, but no model root ran its forward since the last one: the
                # model was made without construction (unpickled): find it once; or the
                # job calls another method of its root (Lightning's training_step): its
                # children are the model. Timed from the next forward on.
                if not self.adopted:
                    self.adopted = True
                    self.modules.adopt_live()
                self.modules.demote_idle()
            self.root_ran = False
        self.bwd_depth += 1

    @_guarded
    def backward_exit(self) -> None:
        self.bwd_depth -= 1
        if self.bwd_depth:
            return
        self.mem("backward", 1, self.now())
        t = self.now()
        with self.lock:
            off = self.off
            partial = [(g.layer, g.last + off) for g in self.grads.values() if g.count]
            start = self.last_mark + off
            _settle(self.grads)
        for layer, end in sorted(partial, key=lambda x: x[1]):  # layers with unused params
            self.rec.span("backward", self.layer_names.get(layer, "layer"), start, end,
                          layer=layer, nbytes=self.layer_grad_bytes.get(layer))
            start = end
        self.rec.span("backward", "backward", self.bwd_t0, t)
        self.last_bwd_end = self.its.last_bwd = t
        self.last_mark = 0
        if self.modules.probes:
            self.modules.backward_done()

    # -- update --------------------------------------------------------------------------
    @_guarded
    def step_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self.engine_steps:   # inside an engine's step (DeepSpeed's), that one is it
            self.update_t0 = self.now()
            self.mem("update", 0, self.update_t0)

    @_guarded
    def step_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self.engine_steps:
            self.stepped(type(opt).__name__)

    @_guarded
    def engine_step(self, begin: bool, name: str) -> None:
        """A training engine's step (DeepSpeed's) begins or ends: the update, and the
        iteration's boundary, are it, not the optimizer steps inside it."""
        if begin:
            if not self.engine_steps:
                self.update_t0 = self.now()
                self.mem("update", 0, self.update_t0)
            self.engine_steps += 1
        else:
            self.engine_steps = max(self.engine_steps - 1, 0)
            if not self.engine_steps:
                self.stepped(name)

    def stepped(self, name: str) -> None:
        self.mem("update", 1, self.now())
        t = self.now()
        # With a closure, forward and backward run inside step(): update starts after them.
        start = max(self.update_t0, self.last_bwd_end if self.last_bwd_end <= t else 0)
        self.rec.span("update", name, start, t)
        self.loss_from = 0
        self.its.stepped(t)


def _patch_optimizer_step(cls: Any) -> None:
    """The update is the whole of `optimizer.step()`: torch wraps each optimizer class's
    step (Optimizer.profile_hook_step: a profiler range and the step hooks around it) on its
    first instance, and the range's entry and exit cost about as much as the hooks leave
    out (0.3 ms of a 6 ms AdamW step on the CPU). Wrapping that wrapper makes the step an
    enclosing step (as DeepSpeed's engine step); the hooks stay for classes wrapped before
    gputrace was installed."""
    orig = cls.__dict__.get("profile_hook_step")
    if not isinstance(orig, staticmethod) or getattr(orig.__func__, "_gputrace", False):
        return
    wrap = orig.__func__

    def profile_hook_step(func: Any) -> Any:
        inner = wrap(func)

        @functools.wraps(inner)
        def step(*args: Any, **kwargs: Any) -> Any:
            st = _installed
            if st is None or not args:
                return inner(*args, **kwargs)
            name = type(args[0]).__name__
            st.engine_step(True, name)
            try:
                return inner(*args, **kwargs)
            finally:
                st.engine_step(False, name)

        return step

    profile_hook_step._gputrace = True  # type: ignore[attr-defined]
    cls.profile_hook_step = staticmethod(profile_hook_step)


def _patch_optimizer_init(cls: Any) -> None:
    """A job that builds an optimizer trains: its forward-only batches before the first
    step are evaluation (iterations.optimizer_made)."""
    orig = cls.__init__
    if getattr(orig, "_gputrace", False):
        return

    made = _guarded(optimizer_made)

    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        made()

    __init__._gputrace = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _patch_backward(state: _State) -> None:
    orig = torch.autograd.backward

    @functools.wraps(orig)
    def backward(*args: Any, **kwargs: Any) -> Any:
        state.backward_enter()
        try:
            return orig(*args, **kwargs)
        finally:
            state.backward_exit()

    backward._gputrace_orig = orig  # type: ignore[attr-defined]
    torch.autograd.backward = backward


def _flops(state: _State) -> None:
    try:
        from gputrace.collectors.torch import flops

        flops.install(state)
    except Exception as e:  # noqa: BLE001 - a torch without FlopCounterMode: no count
        state.rec.set_collector("flops", f"unavailable: {type(e).__name__}: {e}")
        print(f"gputrace: FLOPs not counted: {type(e).__name__}: {e}", file=sys.stderr)


def auto_instrument(rec: Recorder) -> str:
    """Install the hooks once per process; returns the collector status line."""
    global _installed
    if _installed is not None:
        if _installed.rec is not rec:
            _installed.rec = rec
            _installed.now = rec.clock.now_ns
            _installed.push = rec.push_perf
            _installed.off = rec.clock.from_perf(0)
            _installed.its = _Iterations(rec)
            _flops(_installed)
            torch_guard.set_recorder(rec)
            learn_rank_from_torch(rec)
        return "ok"
    layers, forward = env_mode(), env_forward()
    state = _State(rec, layers, forward)
    _installed = state
    torch_guard.set_recorder(rec)
    from torch.optim import optimizer as optim_module

    state.modules.install()
    optim_module.register_optimizer_step_pre_hook(state.step_pre)
    optim_module.register_optimizer_step_post_hook(state.step_post)
    _patch_optimizer_step(optim_module.Optimizer)
    _patch_optimizer_init(optim_module.Optimizer)
    _patch_backward(state)
    patch_dataloader(state)
    patch_ddp(lambda: _installed)
    if torch_comm.install(lambda: _installed):
        _install_distributed()
    torch_checkpoint.install(lambda: _installed)
    torch_startup.install(rec, lambda: _installed)
    torch_lightning.install(lambda: _installed)
    torch_hf_trainer.install(lambda: _installed)
    torch_framework_saves.install(lambda: _installed)
    learn_rank_from_torch(rec)
    _flops(state)
    rec.metadata.setdefault("software", {})["torch"] = torch.__version__
    rec.metadata["torch"] = {"cuda": bool(torch.cuda.is_available()), "layers": layers,
                             "layer_forward": forward, "recompute": "watched"}
    return "ok"


def _install_distributed() -> None:
    """The collectors of what is built on torch.distributed's collectives, each patching
    its library when (if ever) the job imports it."""
    from gputrace.collectors.torch import deepspeed, ds_pipeline, dtensor, mesh, pipeline
    from gputrace.collectors.torch import fsdp as torch_fsdp

    for c in (torch_fsdp, deepspeed, ds_pipeline, mesh, pipeline, dtensor):
        c.install()
