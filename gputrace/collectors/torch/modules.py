"""Which modules of a PyTorch job are timed, and the per-module hooks that time them.

No global module hook: those put every module call of the model (dropout, activations,
attention internals) on torch's slower hooked path, and make `torch.compile(module)` warn.
Instead, torch's global *registration* hooks (called when a module gets a parameter or a
child, never when a module runs) follow how models are built: a module that owns parameters,
directly or through its children, and is nobody's child is a model root and carries a forward
pre-hook and hook; when it becomes a child (of a bigger model, DistributedDataParallel,
`torch.compile`'s wrapper), they move to its new parent. At a root's first forward the
modules to time are chosen (`GPUTRACE_LAYERS`, collectors.torch.module_choice):

- `blocks` (default): the smallest modules that together own the parameters at block level:
  each child of a container (`nn.ModuleList`, `nn.Sequential`, `nn.ModuleDict`) that owns
  parameters (a transformer block, a stage), else every module with parameters of its own;
- `leaves`: every module with parameters of its own;
- `off`: none (phases and iterations only, no per-layer spans).

Each chosen module's last gradient gives its backward (a `backward` span with `layer`, see
collectors.torch.grads): what the analysis uses (gradient readiness of the comm units). Its
forward is timed too (a `forward` span with `layer`, a pre-hook and a hook per call) only
when asked (`GPUTRACE_LAYER_FORWARD=1`, `record --layer-forward`), or when it is tensor
parallel (DTensor parameters: it is on the hooked path already, and the collectives its
forward issues are told by layer): on a 12-block transformer those two hooks per block
cost the loop about 1 %. Otherwise a one-shot pre-hook numbers the module at its first call
(layers 1..L in execution order from the input side) and is removed, and the module runs
unhooked from then on. A compiled model (`torch.compile`) keeps only the parameter hooks: a
hook inside the compiled region would break its graph. A module forward run inside the
backward (activation checkpointing's recompute) is a `recompute` span, never a `forward` one:
collectors.torch.recompute finds the modules recomputed and times them at every choice.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import torch.nn as nn

from gputrace.collectors.torch import recompute
from gputrace.collectors.torch.guard import _hook_failed
from gputrace.collectors.torch.module_choice import (  # noqa: F401 - env_*: here too
    _compiled,
    _tp,
    choose,
    env_forward,
    env_mode,
)
from gputrace.collectors.torch.recompute import in_backward


class _Hook:
    """A module hook of gputrace's that never takes gputrace into a copy of the model: a deep
    copy (an EMA model, a teacher) shares it, as global hooks were shared, instead of
    copying the recorder; a pickled model (`torch.save(model)`) holds a no-op in its place."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __copy__(self) -> _Hook:
        return self

    def __deepcopy__(self, memo: Any) -> _Hook:
        return self

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_NoHook, ())


class _NoHook:
    """What an unpickled model holds where gputrace's hook was."""

    def __call__(self, *args: Any) -> None:
        return None


class Modules:
    """Follows module construction (registration hooks) and keeps root hooks on the roots;
    attaches the per-module timing hooks of a root at its first forward."""

    def __init__(self, state: Any, mode: str, forward: bool = False) -> None:
        self.st = state
        self.mode = mode
        self.forward = forward   # a forward span per call of each chosen module
        self.held: weakref.WeakSet[nn.Module] = weakref.WeakSet()     # owns params, subtree
        self.parented: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.roots: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]] = \
            weakref.WeakKeyDictionary()
        self.seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()     # roots that ran
        self.timed: weakref.WeakKeyDictionary[nn.Module, list[Any]] = \
            weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.adopted: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # roots adopt_live made
        self.probes: list[recompute.Probe] = []    # roots learning what they recompute
        self.recomputed: weakref.WeakKeyDictionary[nn.Module, list[Any]] = \
            weakref.WeakKeyDictionary()
        self.spanned: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # with forward spans

    # -- construction ----------------------------------------------------------------------
    def install(self) -> None:
        from torch.nn.modules import module as nn_module

        nn_module.register_module_parameter_registration_hook(self._on_param)
        nn_module.register_module_module_registration_hook(self._on_child)

    def _on_param(self, module: nn.Module, name: str, param: Any) -> None:
        try:
            if param is not None and module not in self.held:
                self.held.add(module)
                if module not in self.parented:
                    self.make_root(module)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _hook_failed("the parameter registration hook", e)

    def _on_child(self, parent: nn.Module, name: str, child: Any) -> None:
        try:
            if child is None:
                return
            self.parented.add(child)
            self.unroot(child)
            if child in self.held and parent not in self.held:
                self.held.add(parent)
                if parent not in self.parented:
                    self.make_root(parent)
        except Exception as e:  # noqa: BLE001
            _hook_failed("the module registration hook", e)

    def adopt(self, modules: Any) -> None:
        """Modules built before the hooks were installed: the roots among them."""
        mods = [m for m in modules if isinstance(m, nn.Module)]
        children = {id(c) for m in mods for c in m._modules.values() if c is not None}
        for m in mods:
            if id(m) in children:
                self.parented.add(m)
            elif m not in self.roots and any(True for _ in m.parameters()):
                self.held.add(m)
                self.make_root(m)

    def adopt_live(self) -> None:
        """Every module alive now (the garbage collector's view): for models built before
        the hooks were installed, or made without construction (unpickled, deep copies).
        The roots it makes wait for their first forward before `demote_idle` may judge them."""
        import gc

        module = nn.Module
        before = set(map(id, self.roots.keys()))
        self.adopt(o for o in gc.get_objects() if issubclass(type(o), module))
        self.adopted.update(m for m in self.roots.keys() if id(m) not in before)

    def demote_idle(self) -> None:
        """A backward came, and a model root never ran its forward: the job calls something
        else of it (Lightning's `training_step`, a `compute_loss` method) that calls its
        children. Its children that hold parameters become the roots (the module the step
        calls), timed from their next call on; the idle root is no root any more."""
        idle = [m for m in list(self.roots.keys()) if m not in self.seen
                and m not in self.adopted]
        self.adopted.clear()
        for m in idle:
            kids = [c for c in m._modules.values() if c is not None and c in self.held]
            if not kids:
                continue
            self.unroot(m)
            for c in kids:
                self.make_root(c)

    def make_root(self, m: nn.Module) -> None:
        if m in self.roots:
            return
        st = self.st
        pre = m.register_forward_pre_hook(_Hook(st.root_pre))
        post = m.register_forward_hook(_Hook(st.root_post), always_call=True)
        self.roots[m] = (pre, post)

    def outermost(self, m: nn.Module) -> None:
        """The root's hooks around every other hook of it: hooks registered after ours (FSDP2's
        pre-forward all-gather is prepended, its post-forward appended) run inside the
        forward, as its time is the job's. Re-registered at the first forward (from the
        next call on; torch has taken this call's hooks already)."""
        handles = self.roots.get(m)
        if handles is None:
            return
        pre_h, post_h = handles
        pres, posts = list(m._forward_pre_hooks), list(m._forward_hooks)
        if pres[:1] == [pre_h.id] and posts[-1:] == [post_h.id]:
            return
        pre, post = m._forward_pre_hooks[pre_h.id], m._forward_hooks[post_h.id]
        for h in handles:
            h.remove()
        self.roots[m] = (m.register_forward_pre_hook(pre, prepend=True),
                         m.register_forward_hook(post, always_call=True))

    def unroot(self, m: nn.Module) -> None:
        handles = self.roots.pop(m, None)
        if handles is not None:
            for h in handles:
                h.remove()

    # -- first forward of a root -----------------------------------------------------------
    def first_forward(self, root: nn.Module) -> None:
        with self.lock:
            if root in self.seen:
                return
            self.seen.add(root)
        self.outermost(root)
        chosen = choose(root, self.mode)
        st = self.st
        if _compiled(root):
            # hooks inside the compiled region would break its graph: the parameters' hooks
            # only, layers numbered in registration order
            for m, params in chosen:
                for h in self.timed.pop(m, []):
                    h.remove()
                st.layer_for(m, params)
            st.rec.metadata.setdefault("torch", {})["recompute"] = (
                "not seen: a compiled model recomputes inside its compiled backward")
            return
        for m, params in chosen:
            if m not in self.timed:
                spans = self.forward or _tp(m, params)
                if spans:
                    self.spanned.add(m)
                self.timed[m] = self._attach(m, params, spans)
        probe = recompute.Probe(st, root)
        probe.armed = st.bwd_depth == 0
        with self.lock:
            self.probes.append(probe)

    def backward_done(self) -> None:
        """A backward ended: the roots whose probes saw it keep timers on the modules they
        recompute (collectors.torch.recompute), and lose the probes."""
        with self.lock:
            done = [p for p in self.probes if p.armed]
            self.probes = [p for p in self.probes if not p.armed]
            for p in self.probes:
                p.armed = True
        for p in done:
            p.finish(self.spanned, self.recomputed)

    def _attach(self, m: nn.Module, params: list[nn.Parameter], forward: bool) -> list[Any]:
        """With forward spans: one per call of `m`, appended as one tuple (perf_counter_ns
        times, converted when flushed): one Python call, one clock read and one append in
        the pre-hook; one call, one clock read, one tuple and one append in the hook.
        Without: a pre-hook that numbers `m` at its first call and removes itself."""
        if not forward:
            once = _NumberOnce(self.st, params, m)
            once.handle = m.register_forward_pre_hook(once)
            return [once.handle]
        pre = _TimedPre(self.st, params)
        # always called: a non-reentrant recompute that stops early raises inside it
        return [m.register_forward_pre_hook(pre),
                m.register_forward_hook(_TimedPost(pre, type(m).__name__), always_call=True)]


_perf = time.perf_counter_ns
_tid = threading.get_native_id


class _NumberOnce(_Hook):
    """A chosen module's first call: its layer (numbered in execution order, its gradients'
    hooks registered); then the hook is gone and the module's calls take torch's fast path
    again."""

    __slots__ = ("st", "params", "handle", "mod")

    def __init__(self, st: Any, params: list[nn.Parameter], mod: nn.Module) -> None:
        self.fn = None
        self.st, self.params, self.handle = st, params, None
        self.mod = weakref.ref(mod)

    def __call__(self, mod: Any, args: Any) -> None:
        if mod is not self.mod():
            return   # a deep copy's (it shares the hook): the original is still to number
        try:
            if self.handle is not None:
                self.handle.remove()
            self.st.layer_for(mod, self.params)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _hook_failed("forward_pre", e)
        self.params = []


class _TimedPre(_Hook):
    """A timed module's forward pre-hook: its start times (a stack: calls may nest) and its
    layer, numbered at its first call. The hook is the object itself (one Python frame)."""

    __slots__ = ("st", "params", "starts", "layer")

    def __init__(self, st: Any, params: list[nn.Parameter]) -> None:
        self.fn = None
        self.st, self.params, self.starts, self.layer = st, params, [], 0

    def __call__(self, mod: Any, args: Any) -> None:
        self.starts.append(_perf())
        if not self.layer:
            try:
                self.layer = self.st.layer_for(mod, self.params)
            except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
                _hook_failed("forward_pre", e)


class _TimedPost(_Hook):
    """A timed module's forward hook: the span from its pre-hook's start to now; a call
    inside the backward (a recompute: collectors.torch.recompute) is a `recompute` span."""

    __slots__ = ("pre", "name")

    def __init__(self, pre: _TimedPre, name: str) -> None:
        self.fn = None
        self.pre, self.name = pre, name

    def __call__(self, mod: Any, args: Any, out: Any) -> None:
        t = _perf()
        pre = self.pre
        try:
            st = pre.st
            st.push(("recompute" if in_backward() else "forward", self.name,
                     pre.starts.pop(), t, _tid(), st.rec.step, pre.layer, None, None))
        except IndexError:   # hooked during this very call: its start was not taken
            pass
        except Exception as e:  # noqa: BLE001
            _hook_failed("forward_post", e)
