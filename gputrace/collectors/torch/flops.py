"""The FLOPs of one training iteration, counted by PyTorch itself.

One iteration after the first optimizer steps (COUNTED_STEP, 0-based) runs under
`torch.utils.flop_counter.FlopCounterMode`: every operation it knows (matmuls, convolutions,
attention) adds its FLOPs to the modules it runs in (in the backward: the modules whose
forward created the autograd node it runs in, see _Tracker), split here into forward,
backward and recomputation (a module's forward run again inside the backward: activation
checkpointing). The mode sends every operation through
Python, so that iteration is slow. Its spans are written as any other's (the trace keeps
every iteration the job ran, as the job's own clock does); one `span` row of cat `flops`
over its time, with the counts in `args` (docs/format.md), marks it, and the analysis leaves
it out of the timing statistics where it falls among the analyzed iterations (the default
warm-up skip holds it once a job has 6 iterations). The modes it cannot be entered under
safely (compiled graphs, sharded or DTensor parameters, DeepSpeed's engine) are skipped
and the shard's metadata says why (`collectors.flops`; `analyze` says it in one line).
`GPUTRACE_FLOPS=off` (`record --flops off`) leaves the job as without it."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import defaultdict
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

from gputrace.fmt import reason

COUNTED_STEP = 2          # the third iteration: after the first optimizer steps
CAT = "flops"
METHOD = "torch.utils.flop_counter.FlopCounterMode"
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
           torch.float64: "fp64"}


def env_on(value: str | None) -> bool:
    """GPUTRACE_FLOPS: on (default) or off."""
    return (value or "on").strip().lower() not in ("0", "off", "false", "no")


class _Tracker(ModuleTracker):
    """torch's ModuleTracker in the forward; in the backward, each autograd node is charged
    to the modules whose forward created it.

    torch's tracker enters a module in the backward when its outputs' gradients are ready
    and leaves it when its inputs' are: an input shared with a sibling branch (a residual
    block's input, used by its 1x1 shortcut convolution and by its main branch) has its
    gradient only once both branches ran, so the shortcut stayed entered through the main
    branch's whole backward and was charged it (a ResNet's shortcut convolution had 28x its
    own backward FLOPs, and the layers' backward summed to 1.6x the model's). Here a
    module's forward hook claims the nodes its call created (autograd's sequence numbers
    from its pre-hook on, reached from its outputs; the innermost module first, as its hook
    runs first), and a backward operation counts to the modules that created the node
    running it (`torch._C._current_autograd_node`): the same modules its forward counted to.

    A forward that runs inside a backward (recomputed by activation checkpointing) is kept
    apart: `recomputing` holds its modules; the nodes it makes are claimed as well (a
    reentrant checkpoint runs their backward inside its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.recomputing: dict[str, int] = defaultdict(int)
        # per module call under way: autograd's sequence number at its pre-hook (a stack:
        # calls nest; a call stopped inside, as checkpointing's early stop does, leaves one)
        self.starts: dict[int, list[int]] = defaultdict(list)
        self.broken: str | None = None     # why tracking failed (the job's forward went on)

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:
        try:
            name = self._get_mod_name(mod)
            self.starts[id(mod)].append(torch._C._autograd._get_sequence_nr())
            if self.is_bw:
                self.recomputing[name] += 1
            else:
                self.parents.add(name)
        except Exception as e:  # noqa: BLE001 - a module hook of ours: never into the job
            self.broken = f"module tracking failed: {reason(e)}"

    def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
        try:
            name = self._get_mod_name(mod)
            calls = self.starts.get(id(mod))
            start = calls.pop() if calls else None     # None: entered before the count
            if self.is_bw:
                left = self.recomputing.pop(name, 0) - 1
                if left > 0:
                    self.recomputing[name] = left
                owners = _with_ancestors(name)
            else:
                self.parents.discard(name)
                owners = frozenset((*self.parents, name))
            if start is not None:
                self._claim(output, start, owners)
        except Exception as e:  # noqa: BLE001
            self.broken = f"module tracking failed: {reason(e)}"

    def _claim(self, output: Any, start: int, owners: frozenset[str]) -> None:
        """The nodes created since `start` that `output` depends on, not claimed yet (by a
        module inside this one), charged to `owners`."""
        from torch.utils._pytree import tree_flatten

        args, _ = tree_flatten(output)
        todo = [a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None]
        # the nodes themselves, not their ids: a C++ node's Python object lives only while
        # referenced, and another's could take a freed one's id during the walk
        seen: set[Any] = set()
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if node._sequence_nr() < start:
                continue        # made before this call: an input's
            # kept on the node itself (its metadata lives and goes with it): a reference of
            # ours would keep what a node holds (a recomputed forward's activations, which
            # checkpointing frees) to the iteration's end
            node.metadata.setdefault(_KEY, owners)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def owners(self) -> frozenset[str]:
        """The modules a backward operation counts to: those that created the node it runs
        in ("Global" alone for a node made outside every module: the loss)."""
        node = torch._C._current_autograd_node()
        return _GLOBAL if node is None else node.metadata.get(_KEY, _GLOBAL)

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        self.starts.clear()


_GLOBAL = frozenset({"Global"})
_KEY = "gputrace.flops.owners"      # in an autograd node's metadata: the modules it counts to


def _with_ancestors(name: str) -> frozenset[str]:
    """A module's name, the names above it (its path's prefixes), and "Global"."""
    parts = name.split(".")
    return frozenset({"Global", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))})


class _Count(FlopCounterMode):
    """FlopCounterMode with each module's FLOPs split into forward, backward and recompute,
    and the FLOPs per input dtype and device."""

    def __init__(self) -> None:
        super().__init__(display=False)
        if isinstance(getattr(self, "mod_tracker", None), ModuleTracker):
            self.mod_tracker = _Tracker()
        self.split: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.devices: dict[str, int] = defaultdict(int)
        self.broken: str | None = None      # why counting stopped (a failure of ours)

    def _owners(self, bw: bool, again: bool) -> set[str] | frozenset[str]:
        """The modules an operation counts to: in the forward, the tracker's parents; in the
        backward, the modules that created the node it runs in; for an operation of a
        recomputed forward, the recomputed modules and every module above them."""
        t = self.mod_tracker
        if not isinstance(t, _Tracker):
            return set(t.parents)
        if not bw:
            return set(t.parents)
        if not again:
            # a recomputation has ended when the backward's own products run again (one
            # stopped early by torch, past the modules' ends, left its names behind)
            t.recomputing.clear()
            return t.owners()
        out: set[str] = {"Global"}
        for name in t.recomputing:
            out |= _with_ancestors(name)
        return out

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        """torch's, never raising into the job: a failure (a FLOP formula that rejects a
        shape) ends the count, said at the iteration's end."""
        if self.broken:
            return out
        try:
            self._count(func_packet, out, args, kwargs)
        except Exception as e:  # noqa: BLE001 - the operation ran; only its count failed
            self.broken = f"counting {func_packet} failed: {reason(e)}"
        return out

    def _count(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> None:
        fn = self.flop_registry.get(func_packet)
        if fn is None:
            return
        n = int(fn(*args, **kwargs, out_val=out))
        t = self.mod_tracker
        bw = t.is_bw
        # a backward's own operations run without grad (unless it makes a graph itself:
        # create_graph, which recomputes nothing); a forward recomputed inside it
        # (checkpointing) runs with grad, inside a recomputed module
        again = bw and torch.is_grad_enabled() and (
            bool(t.recomputing) if isinstance(t, _Tracker) else True)
        for par in self._owners(bw, again):
            self.flop_counts[par][func_packet] += n
            c = self.split[par]
            c[1 if bw else 0] += n
            if again:
                c[2] += n
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None:
            self.by_dtype[_DTYPES.get(x.dtype, str(x.dtype))] += n
            self.devices[x.device.type] += n


def why_not(st: Any) -> str | None:
    """Why FlopCounterMode cannot be entered safely around this job's iteration (None: it
    can)."""
    from gputrace.collectors.torch.modules import _compiled

    roots = list(st.modules.seen)
    if st.pipeline_steps or "torch.distributed.pipelining" in sys.modules:
        who = "DeepSpeed's pipeline engine" if st.pipeline_steps and \
            "deepspeed.runtime.pipe.engine" in sys.modules else "torch.distributed.pipelining"
        return f"a pipeline schedule runs the model in microbatches ({who}): not counted yet"
    if any(_compiled(r) for r in roots) or _dynamo_compiled():
        return "the model runs torch.compile's graphs (FlopCounterMode would recompile them)"
    dt = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for r in roots:
        for m in r.modules():
            name = type(m).__name__
            if name.startswith(("FSDP", "FullyShardedDataParallel")):
                return "FSDP shards the parameters"
            if name == "DeepSpeedEngine":
                return "DeepSpeed's engine partitions and hooks the parameters"
            if dt is not None and any(isinstance(p, dt) for p in m._parameters.values()):
                return "DTensor parameters (FSDP2, tensor parallelism)"
    return None


def _dynamo_compiled() -> bool:
    if "torch._dynamo" not in sys.modules:
        return False
    try:
        from torch._dynamo.utils import counters

        return bool(counters["stats"].get("unique_graphs"))
    except Exception:  # noqa: BLE001 - no such counters: nothing compiled that we know
        return False


class FlopWatch:
    """Counts the FLOPs of iteration `step` of a recorder's loop (rec.iteration_watchers)."""

    def __init__(self, st: Any, step: int = COUNTED_STEP) -> None:
        self.st, self.rec, self.step = st, st.rec, step
        self.count: _Count | None = None
        self.thread = 0
        self.window: list[Any] | None = None
        self.done = False
        self.rec.iteration_watchers = (*self.rec.iteration_watchers, self.on_iteration)
        self.rec.close_hooks.append(self.finish)
        self.rec.set_collector(CAT, f"unavailable: the job ran fewer than {step + 1} "
                               "training iterations", step=step)

    def _say(self, why: str, failed: bool = False) -> None:
        """No count, and why (the metadata; `analyze` says it): a mode it is not entered
        under is said there only, so the job's own output stays its own; a failure of ours
        also in one line on stderr."""
        self.done = True
        self.rec.set_collector(CAT, f"unavailable: {why}", step=self.step)
        if failed:
            print(f"gputrace: FLOPs not counted: {why}", file=sys.stderr)

    def on_iteration(self, event: str, step: int, t_ns: int, name: str = "") -> None:
        try:
            if self.count is not None:
                if threading.get_ident() != self.thread:
                    return        # the mode is the entering thread's: left there to leave
                if event == "drop" or (event == "close" and name == "inference"):
                    # a batch that trained nothing (evaluation), or the loop's end: the
                    # next iteration is counted instead
                    self._discard(step + (event == "close"))
                elif event == "close" and step == self.step:
                    self._end(t_ns)
                elif step > self.step:
                    self._end(t_ns, "the counted iteration did not end where it began")
            elif not self.done and event == "open" and step == self.step:
                self._begin(t_ns)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            self._say(f"counting failed: {reason(e)}", failed=True)

    def _discard(self, next_step: int) -> None:
        count, self.count = self.count, None
        if count is not None:
            count.__exit__(None, None, None)
        self.step, self.window = next_step, None

    def _begin(self, t_ns: int) -> None:
        if not self.st.its.seen_step:
            # evaluation before the first training step (its batches are iterations too):
            # the count waits for an iteration after an optimizer step
            self.step += 1
            self.rec.set_collector(CAT, "unavailable: no optimizer step marked the "
                                   "iterations while the job ran", step=self.step)
            return
        why = why_not(self.st)
        if why:
            self._say(why)
            return
        count = _Count()
        count.__enter__()
        self.count, self.thread = count, threading.get_ident()
        self.window = [t_ns, None]

    def _end(self, t_ns: int, failed: str | None = None) -> None:
        count, self.count = self.count, None
        assert count is not None and self.window is not None
        self.window[1] = t_ns
        count.__exit__(None, None, None)
        failed = failed or count.broken or getattr(count.mod_tracker, "broken", None)
        if failed:
            self._say(failed, failed=True)
            return
        self.done = True
        args = summary(count, self.st)
        self.rec.row("span", CAT, "iteration", self.window[0], t_ns, step=self.step,
                     args=json.dumps(args, separators=(",", ":")))
        self.rec.set_collector(CAT, "ok", step=self.step, method=METHOD)

    def finish(self, t_ns: int) -> None:
        if self.count is not None and threading.get_ident() == self.thread:
            self._end(t_ns)   # the job's last iteration, ended by the job's end


def summary(count: _Count, st: Any) -> dict[str, Any]:
    """What the `flops` row's args hold: totals, per layer, the dtype and device."""
    split = count.split
    f, b, r = split["Global"] if "Global" in split else (0, 0, 0)
    names = {name: st.layer_of.get(id(m)) for m, name in count.mod_tracker._known_modules.items()}
    layers = []
    for name, layer in sorted(((n, ly) for n, ly in names.items() if ly),
                              key=lambda x: x[1]):
        lf, lb, lr = split.get(name, (0, 0, 0))
        layers.append({"layer": layer, "name": st.layer_names.get(layer, name), "module": name,
                       "flops_f": lf, "flops_b": lb, "flops_recompute": lr})
    dtype = max(count.by_dtype, key=lambda k: count.by_dtype[k]) if count.by_dtype else None
    device = max(count.devices, key=lambda k: count.devices[k]) if count.devices else "cpu"
    out: dict[str, Any] = {
        "method": METHOD, "flops_f": f, "flops_b": b, "flops_recompute": r,
        "model_flops": f + b - r, "hardware_flops": f + b, "dtype": dtype, "device": device,
        "by_dtype": dict(count.by_dtype), "layers": layers,
        "ops": {str(k): v for k, v in count.flop_counts.get("Global", {}).items()}}
    if device == "cuda":
        try:
            out["device_name"] = torch.cuda.get_device_name()
            out["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
            if dtype == "fp32" and out["tf32"]:
                out["dtype"] = "tf32"
        except Exception:  # noqa: BLE001 - the name is a nicety
            pass
    return out


def install(st: Any) -> FlopWatch | None:
    """Count one iteration's FLOPs unless GPUTRACE_FLOPS is off."""
    if not env_on(os.environ.get("GPUTRACE_FLOPS")):
        st.rec.set_collector(CAT, "off")
        return None
    return FlopWatch(st)
