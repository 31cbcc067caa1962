"""Activation checkpointing's recomputed forward, seen where it runs: inside the backward.

A module forward that begins while autograd's backward runs on its thread (a graph task
is current: `torch._C._current_graph_task_id() != -1`) is a recompute: torch.utils.checkpoint
(reentrant or not), `checkpoint_wrapper` (FSDP2, torchtitan) and transformers' gradient
checkpointing all run the checkpointed modules' forward again there. It is the backward's
work, and is written as a `recompute` span (not `forward`: nothing that reads forward spans
counts it, and the GPU work launched in it stays the backward's).

Which modules are recomputed is learned once per model root, from evidence: from the root's
first forward until the next backward has run, every module of the model (not inside a
compiled module) carries a probe pre-hook and hook that note the modules run inside the
backward, and when; then the probes go. The modules recomputed that are outermost (no
recomputed module above them), and the layers recomputed, get their calls in that backward
written, and keep a pre-hook and an always-called hook (a non-reentrant recompute that stops
early raises inside them) that time each recomputed call from then on: a `recompute` span
with `layer`, the layer the module is or is inside of (-1: above several layers, or outside
every layer). Their forwards outside the backward pay one check each.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import torch
import torch.nn as nn

from gputrace.collectors.torch.guard import _hook_failed
from gputrace.collectors.torch.module_choice import _compiled

_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward now (False where torch cannot
    tell)."""
    return _graph_task is not None and _graph_task() != -1


_perf = time.perf_counter_ns
_tid = threading.get_native_id


class _Shared:
    """A hook of ours that a copy of the model shares, and a pickled model drops (as
    modules._Hook)."""

    __slots__ = ()

    def __copy__(self) -> _Shared:
        return self

    def __deepcopy__(self, memo: Any) -> _Shared:
        return self

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_Nothing, ())


class _Nothing:
    """What an unpickled model holds where our hook was."""

    def __call__(self, *args: Any) -> None:
        return None


class _ProbePre(_Shared):
    """A probe's pre-hook: notes its module, and when it began, when it runs inside the
    backward."""

    __slots__ = ("probe",)

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def __call__(self, mod: Any, args: Any) -> None:
        if _graph_task is not None and _graph_task() != -1:
            p = self.probe
            p.hit.add(id(mod))
            p.starts.setdefault(id(mod), []).append(_perf())


class _ProbePost(_Shared):
    """A probe's hook (always called): each recomputed call, kept until the probe knows
    which modules to time (the probe's iteration gets its recompute spans too)."""

    __slots__ = ("probe",)

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def __call__(self, mod: Any, args: Any, out: Any = None) -> None:
        t = _perf()
        starts = self.probe.starts.get(id(mod))
        if starts and _graph_task is not None and _graph_task() != -1:
            self.probe.calls.append((id(mod), starts.pop(), t, _tid(), self.probe.st.rec.step))


class Probe:
    """The probes of one model root, until the backward after its first forward ended."""

    def __init__(self, st: Any, root: nn.Module) -> None:
        self.st = st
        self.root = weakref.ref(root)
        self.hit: set[int] = set()
        self.starts: dict[int, list[int]] = {}
        self.calls: list[tuple[int, int, int, int, Any]] = []   # module id, start, end, ...
        self.handles: list[Any] = []
        self.armed = True       # a backward began after it: that backward's end ends it
        pre, post = _ProbePre(self), _ProbePost(self)
        for m in _modules(root):
            self.handles += [m.register_forward_pre_hook(pre),
                             m.register_forward_hook(post, always_call=True)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def finish(self, spanned: Any, timers: Any) -> None:
        """The probes go; the modules to time (`targets`) get their calls in the probe's
        backward written and their timers (kept in `timers`, module -> hook handles)."""
        self.remove()
        root = self.root()
        if root is None or not self.hit:
            return
        for m, layer in targets(root, self.hit, self.st.layer_of, spanned):
            if m not in timers:
                replay(self.st, self, m, layer)
                timers[m] = attach(self.st, m, layer)


def _modules(root: nn.Module) -> list[nn.Module]:
    """The root's modules, each once, not those inside a compiled module (a hook there would
    break its graph; a recompute inside it runs in its compiled backward, unseen)."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        if not _compiled(m):
            stack.extend(c for c in m._modules.values() if c is not None)
    return out


def targets(root: nn.Module, hit: set[int], layer_of: dict[int, int], timed: Any
            ) -> list[tuple[nn.Module, int]]:
    """The recomputed modules to time, each with its layer: the outermost recomputed ones
    (the layer they are or are inside of, else -1), and every layer recomputed below them
    that is not timed already (`timed`: modules with forward spans, which write their own)."""
    out: list[tuple[nn.Module, int]] = []
    seen: set[int] = set()

    def walk(m: nn.Module, layer: int, under: bool) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        own = layer_of.get(id(m), 0)
        here = id(m) in hit
        if here and m not in timed and (not under or own > 0):
            out.append((m, own if own > 0 else layer))
        if _compiled(m):
            return
        for c in m._modules.values():
            if c is not None:
                walk(c, own if own > 0 else layer, under or here)

    walk(root, -1, False)
    return out


class _RecomputePre(_Shared):
    """A recomputed module's pre-hook: its start, inside the backward only."""

    __slots__ = ("starts",)

    def __init__(self) -> None:
        self.starts: list[int] = []

    def __call__(self, mod: Any, args: Any) -> None:
        if _graph_task is not None and _graph_task() != -1:
            self.starts.append(_perf())


class _RecomputePost(_Shared):
    """A recomputed module's hook (always called): the `recompute` span from its start."""

    __slots__ = ("st", "pre", "name", "layer")

    def __init__(self, st: Any, pre: _RecomputePre, name: str, layer: int) -> None:
        self.st, self.pre, self.name, self.layer = st, pre, name, layer

    def __call__(self, mod: Any, args: Any, out: Any = None) -> None:
        t = _perf()
        starts = self.pre.starts
        if not starts or _graph_task is None or _graph_task() == -1:
            return
        try:
            st = self.st
            st.push(("recompute", self.name, starts.pop(), t, _tid(), st.rec.step,
                     self.layer, None, None))
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _hook_failed("recompute_post", e)


def replay(st: Any, probe: Probe, m: nn.Module, layer: int) -> None:
    """The recompute spans of `m` in the probe's backward."""
    name = type(m).__name__
    for k, s, e, tid, step in probe.calls:
        if k == id(m):
            st.push(("recompute", name, s, e, tid, step, layer, None, None))


def attach(st: Any, m: nn.Module, layer: int) -> list[Any]:
    pre = _RecomputePre()
    return [m.register_forward_pre_hook(pre),
            m.register_forward_hook(_RecomputePost(st, pre, type(m).__name__, layer),
                                    always_call=True)]
