"""When each timed layer's gradients are ready: the end of its backward.

A layer's backward ends when the last of its parameters' gradients has been accumulated
into `.grad`: that is what a gradient bucket waits for. One post-accumulate-grad hook on
the parameter whose gradient comes last tells it; autograd runs a graph's gradients in the
same order each time, so that parameter ends the layer in every backward.

Which parameter comes last is learned in a layer's first backward with tensor pre-hooks
(`register_hook`) on all of its parameters: each counts a gradient as it is about to be
accumulated, and the last one registers the post-accumulate-grad hook on its own parameter
(it fires after that very accumulation). Once the layer has had all its gradients, the
pre-hooks go, and so do torch's own C++ hooks behind them: a tensor's pre-hooks are cleared
when its `_backward_hooks` is set to None, done only where that dict is empty (a pre-hook
of the job's stays). Like any Python pre-hook, the first on a tensor clears a pre-hook a C++
extension registered on it in C++ (a rule of torch's).

A post-accumulate-grad hook cannot be taken back that way: its C++ side stays for the
tensor's life even with the handle removed, and calls into Python (the GIL, a wrapped
tensor) at every accumulation, about 1 us a parameter. So the layer's other parameters
never get one, unless the one kept misses while the layers beside it came (a routed expert,
a skipped branch): then all of them get one for good (`_settle`).

Where gradients come without autograd's accumulation, no pre-hook sees them: FSDP2 sets its
sharded parameters' `.grad` after their reduce-scatter and calls their post-accumulate-grad
hooks itself (from Python: nothing stays in C++). A layer whose gradients came that way in a
backward gets post-accumulate-grad hooks on all its parameters, then keeps the one that
comes last; its spans begin with the second backward.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from gputrace.collectors.torch.guard import _hook_failed

_perf = time.perf_counter_ns
_tid = threading.get_native_id


class _LayerGrads:
    """One timed layer's gradient hooks. As a post-accumulate-grad hook (the object itself:
    one Python frame per call, a clock read and a count), its n-th call ends the layer's
    backward, from the end of the layer before it (or the backward's start), appended as one
    perf-clock tuple like a forward span. A layer some of whose parameters got no gradient
    is ended by the backward's exit, at its last gradient (`count`, `last`).

    States: "probe" (a pre-hook on every parameter, a post-accumulate-grad hook on the last
    one once it is known), "one" (that hook only), "kept" (a post-accumulate-grad hook on
    every parameter, for good), "all" (the same until a backward tells the last one: where
    gradients come without autograd's accumulation, as FSDP2's sharded parameters' do).

    No lock: one backward's hooks run on one autograd thread per device, and the GIL keeps
    the read and write of the last mark apart from another's but for a switch between them,
    which at worst starts a layer of one device at the end of another device's."""

    __slots__ = ("st", "layer", "name", "nbytes", "n", "total", "count", "last", "done",
                 "final", "params", "probes", "post", "state")

    def __init__(self, st: Any, layer: int, name: str) -> None:
        self.st, self.layer, self.name, self.nbytes = st, layer, name, 0
        self.n = 1                # post-accumulate-grad calls that end the layer
        self.total = 0            # parameters that get gradients
        self.count, self.last = 0, 0
        self.done = False         # the layer's backward ended in the running backward
        self.final: Any = None    # the parameter whose gradient ended it (state "all")
        self.params: list[weakref.ref[Any]] = []   # weak: the model's lifetime is its own
        self.probes: list[Any] = []                # the pre-hooks' handles, while probing
        self.post: dict[int, Any] = {}   # parameter index -> its post-accumulate-grad hook
        self.state = "probe"

    def add(self, p: Any) -> None:
        self.probes.append(p.register_hook(_Probe(self, len(self.params))))
        self.st.probing.add(self)
        self.params.append(weakref.ref(p))
        self.total += 1

    def probed(self, i: int) -> None:
        """Parameter i's gradient is about to be accumulated (a pre-hook, while probing)."""
        self.last = _perf()
        c = self.count + 1
        if c < self.total:
            self.count = c
            return
        self.count = 0
        if i not in self.post:
            p = self.params[i]()
            if p is None:
                return
            for h in self.post.values():   # a last one that never fired (an empty hook stays)
                h.remove()
            self.post = {i: p.register_post_accumulate_grad_hook(self)}

    def __call__(self, param: Any) -> None:
        t = _perf()
        self.last = t
        c = self.count + 1
        if c < self.n:
            self.count = c
            return
        self.count = 0
        self.done = True
        self.final = param
        try:
            st = self.st
            start = st.last_mark or t
            st.last_mark = t
            rec = st.rec
            tid = _tid()
            if tid not in rec.threads:    # an autograd device thread: named once
                rec._new_thread(tid)
            st.push(("backward", self.name, start, t, tid, rec.step, self.layer, self.nbytes,
                     None))
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _hook_failed("grad_ready", e)

    def unprobe(self, state: str = "one") -> None:
        """The last parameter is known (or the pre-hooks cannot tell it): the pre-hooks go,
        torch's C++ side with them where the tensor holds no other pre-hook."""
        for ref, h in zip(self.params, self.probes, strict=True):
            h.remove()
            p = ref()
            if p is not None and p._backward_hooks is not None and not p._backward_hooks:
                p._backward_hooks = None
        self.probes = []
        self.state = state
        self.st.probing.discard(self)

    def given(self) -> bool:
        """Gradients came though no pre-hook saw them: set outside autograd's accumulation
        (FSDP2 sets its sharded parameters' `.grad` after their reduce-scatter and calls
        their post-accumulate-grad hooks itself)."""
        return any((p := ref()) is not None and p.grad is not None for ref in self.params)

    def hook_given(self) -> None:
        """Every parameter gets a post-accumulate-grad hook ("all"); after a backward in
        which all of them came, the one whose gradient came last keeps it (`keep_last`).
        Whoever calls them, not autograd, leaves no C++ hook behind."""
        self.unprobe("all")
        self._hook_every()

    def keep_last(self) -> None:
        """State "all": only the parameter whose gradient came last keeps the hook."""
        keep = next((i for i in self.post if self.params[i]() is self.final), None)
        for i, h in self.post.items():
            if i != keep:
                h.remove()
        self.post = {keep: self.post[keep]} if keep is not None else {}
        self.n, self.state = 1, "one"

    def hook_all(self) -> None:
        """Every parameter gets its post-accumulate-grad hook back, for good."""
        self.state = "kept"
        self._hook_every()

    def _hook_every(self) -> None:
        """A post-accumulate-grad hook on every parameter alive (one that has it keeps it)."""
        self.n = 0
        for i, ref in enumerate(self.params):
            p = ref()
            if p is None:
                continue
            if i not in self.post:
                self.post[i] = p.register_post_accumulate_grad_hook(self)
            self.n += 1


class _Probe:
    """A pre-hook on one parameter of a layer that is learning its last gradient."""

    __slots__ = ("g", "i")

    def __init__(self, g: _LayerGrads, i: int) -> None:
        self.g, self.i = g, i

    def __call__(self, grad: Any) -> None:
        try:
            self.g.probed(self.i)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _hook_failed("grad_probe", e)


def _settle(grads: dict[int, _LayerGrads]) -> None:
    """At the end of a backward: a layer all of whose gradients came keeps one hook; a
    probing layer whose gradients came without its pre-hooks gets post-accumulate-grad
    hooks; a layer down to one whose hook did not fire while a layer beside it did gets all
    of them back. Every layer's count starts again for the next backward."""
    for layer, g in grads.items():
        if g.done:
            if g.state == "probe":
                g.unprobe()
            elif g.state == "all" and g.final is not None:
                g.keep_last()
        elif g.state == "probe":
            if not g.count and g.given():
                g.hook_given()
        elif g.state == "one" and any(
                (n := grads.get(layer + d)) is not None and n.done for d in (-1, 1)):
            g.hook_all()
    for g in grads.values():
        # the model's parameters are not held past a backward
        g.count, g.done, g.final = 0, False, None


def _begin(probing: set[_LayerGrads]) -> None:
    """A backward begins: what the probes counted since the last one was no backward's
    (`torch.autograd.grad` runs the pre-hooks, and accumulates nothing)."""
    for g in probing:
        g.count = 0
