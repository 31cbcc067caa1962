"""Each pipeline stage's compute at other microbatch sizes, timed inside the job
(`record --pp-probe`, env GPUTRACE_PP_PROBE=1): what one run cannot tell, how a
microbatch's forward and backward cost changes with its size, for the microbatch what-ifs.

- At each stage's forward in the schedule's second step (the first infers the shapes), the
  stage module's inputs for that microbatch are kept (one copy per stage, detached).
- When the recording closes (after the job's last iteration), each kept stage runs its
  module's forward and backward on those inputs cut to half the rows and doubled (the
  batch dimension: every tensor whose first dimension is the microbatch's rows), and on
  them as they were, ROUNDS times in turn after one warm-up each, and the rounds' lower
  quartile (another process only ever adds time to a round) goes into
  the shard's metadata, `pipeline.probe`: {"microbatches", "rows", "rounds", "start_ns",
  "end_ns", "stages": [{"stage", "rows": [...], "forward_s": [...], "backward_s": [...],
  "forward_rounds_s": [[...], ...], "backward_rounds_s": [[...], ...], "input_s",
  "weight_s", "input_rounds_s", "weight_rounds_s"}]} (those figures, and each size's
  rounds; `input_s` and `weight_s`: at the recorded rows, the backward split into its input
  and weight parts as the zero-bubble schedules split it, timed in the same rounds as the
  fused one, or `split_skipped` with the reason), or `pipeline.probe_skipped` with the
  reason.
- Its time is the job's: a `process` span `pp_probe` (the process's `run` span holds it;
  the whole run's shut-down gives it apart). Nothing of the job changes: the backward accumulates into gradients of the probe's own
  (the parameters' `.grad` put back after), buffers (batch-norm statistics) and the random
  generators are restored, the module's training mode is the one it had in the step, and
  gputrace's own hooks on the stage's modules and parameters are set aside meanwhile, so the
  probe records no span. A stage whose parameters are sharded or replicated by a wrapper
  that communicates in its forward or backward (FSDP, DDP, DTensor) is not probed: ranks
  could wait for one another at exit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

ENV = "GPUTRACE_PP_PROBE"
ROUNDS = 10           # timed repeats per size, after one warm-up each
BUDGET_S = 30.0       # the probe stops its rounds past this (the job is exiting)
CAPTURE_STEP = 2      # the schedule step whose forwards give the inputs kept
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
               "_backward_hooks")
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


_ON = os.environ.get(ENV) == "1"   # read once: the recording's setting


def enabled() -> bool:
    return _ON


_probes: dict[int, Probe] = {}   # id(recorder) -> its probe


def chunk(st: Any, stage: Any, chunk_id: int) -> Any:
    """The context a stage's forward chunk runs in: its inputs kept when probing and this
    is the chunk to keep (else a no-op)."""
    if not enabled():
        return contextlib.nullcontext()
    probe = _probes.get(id(st.rec))
    if probe is None:
        probe = _probes[id(st.rec)] = Probe(st.rec)
    return probe.forward_chunk(stage, chunk_id, int(getattr(stage, "chunks", 0) or 0))


class _Kept:
    def __init__(self, stage: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int,
                 training: bool, microbatches: int) -> None:
        self.stage_index = int(stage.stage_index)
        self.module = stage.submod
        self.args, self.kwargs, self.rows = args, kwargs, rows
        self.training, self.microbatches = training, microbatches


class Probe:
    """The inputs kept per stage, and the close hook that times them."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.kept: dict[int, _Kept] = {}
        self.steps: dict[int, int] = {}     # stage index -> its forwards of chunk 0 seen
        self.skipped = ""
        # first of the close hooks: the process's `run` span, written after, holds it
        rec.close_hooks.insert(0, self.close)

    def forward_chunk(self, stage: Any, chunk_id: int, n_microbatches: int) -> Any:
        """Before a stage's forward chunk: a context that keeps its module's inputs when
        this is the chunk to keep (else a no-op)."""
        k = int(stage.stage_index)
        if chunk_id == 0:
            self.steps[k] = self.steps.get(k, 0) + 1
        if k in self.kept or self.steps.get(k, 0) != CAPTURE_STEP or chunk_id != 0:
            return contextlib.nullcontext()
        why = getattr(stage, "refuse", "") or _unprobable(stage.submod)
        if why:
            self.skipped = why
            return contextlib.nullcontext()
        return self._capture(stage, n_microbatches)

    @contextlib.contextmanager
    def _capture(self, stage: Any, n_microbatches: int) -> Iterator[None]:
        def keep(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            try:
                rows = _rows(args, kwargs)
                if rows:
                    self.kept[int(stage.stage_index)] = _Kept(
                        stage, _copy(args), _copy(kwargs), rows, bool(mod.training),
                        n_microbatches)
            except Exception as e:  # noqa: BLE001 - inside the job's forward: said, not raised
                self.skipped = f"its inputs could not be kept: {type(e).__name__}: {e}"

        h = stage.submod.register_forward_pre_hook(keep, with_kwargs=True)
        try:
            yield
        finally:
            h.remove()

    def close(self, t_ns: int) -> None:
        d = self.rec.metadata.get("pipeline")
        if not isinstance(d, dict):
            return
        if not self.kept:
            d["probe_skipped"] = self.skipped or (
                "no stage's forward was seen in a second schedule step (a run of one step)")
            return
        t0 = self.rec.clock.now_ns()
        stages = []
        for k in sorted(self.kept):
            stages.append(_time_stage(self.kept[k]))
        kept = next(iter(self.kept.values()))
        t1 = self.rec.clock.now_ns()
        d["probe"] = {"microbatches": kept.microbatches, "rows": kept.rows, "rounds": ROUNDS,
                      "start_ns": t0, "end_ns": t1, "stages": stages}
        # the job's time it took: the whole run's shut-down tells it apart
        self.rec.span("process", "pp_probe", t0, t1, step=-1,
                      args={"stages": [s["stage"] for s in stages]})
        self.kept.clear()


def _unprobable(mod: Any) -> str:
    """Why the stage module cannot be run alone here ("" when it can)."""
    for m in mod.modules():
        name = type(m).__name__
        if name.startswith(("FSDP", "FullyShardedDataParallel", "DistributedDataParallel")):
            return f"the stage holds a {name} (its forward or backward communicates)"
    for p in mod.parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return "the stage's parameters are DTensors (its forward or backward communicates)"
    return ""


def _tensors(x: Any) -> Iterator[Any]:
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The microbatch's rows: the first dimension of the first tensor input."""
    for t in _tensors((args, kwargs)):
        return int(t.shape[0]) if t.dim() else 0
    return 0


def _map(x: Any, f: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return f(x)
    if isinstance(x, tuple):
        return tuple(_map(y, f) for y in x)
    if isinstance(x, list):
        return [_map(y, f) for y in x]
    if isinstance(x, dict):
        return {k: _map(y, f) for k, y in x.items()}
    return x


def _copy(x: Any) -> Any:
    return _map(x, lambda t: t.detach().clone().requires_grad_(t.requires_grad))


def _resized(x: Any, rows: int, to: int) -> Any:
    """`x` with every tensor of `rows` rows cut to `to` rows or repeated up to them."""
    import torch

    def f(t: Any) -> Any:
        if t.dim() == 0 or t.shape[0] != rows:
            v = t.detach()
        elif to <= rows:
            v = t.detach()[:to]
        else:
            v = torch.cat([t.detach()] * -(-to // rows))[:to]
        return v.clone().requires_grad_(t.requires_grad)
    return _map(x, f)


def _lower_quartile(xs: list[float]) -> float:
    """A size's figure: the lower quartile of its rounds (another process only ever adds
    time to one), as numpy's default (linear) quantile."""
    v = sorted(xs)
    k = (len(v) - 1) * 0.25
    i = int(k)
    return v[i] + (v[min(i + 1, len(v) - 1)] - v[i]) * (k - i)


def _ours(h: Any) -> bool:
    return str(getattr(getattr(h, "func", h), "__module__", "") or "").startswith("gputrace")


@contextlib.contextmanager
def _quiet(mod: Any) -> Iterator[None]:
    """gputrace's hooks on `mod`'s modules and parameters set aside (their dicts changed
    in place: autograd holds the parameters' own), put back in their order after."""
    saved: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
    holders = [(m, _HOOK_DICTS) for m in mod.modules()] + \
        [(p, _TENSOR_HOOKS) for p in mod.parameters()]
    for obj, names in holders:
        for name in names:
            d = getattr(obj, name, None)
            if isinstance(d, dict) and any(_ours(h) for h in d.values()):
                items = list(d.items())
                saved.append((d, items))
                d.clear()
                d.update((k, h) for k, h in items if not _ours(h))
    try:
        yield
    finally:
        for d, items in saved:
            d.clear()
            d.update(items)


def _time_stage(kept: _Kept) -> dict[str, Any]:
    import torch

    mod, r = kept.module, kept.rows
    sizes = [s for s in (r // 2, r, 2 * r) if s >= 1]
    sizes = list(dict.fromkeys(sizes))
    params = [p for p in mod.parameters() if p.requires_grad]
    cuda = sorted({t.device.index or 0 for t in [*params, *_tensors(kept.args)]
                   if t.device.type == "cuda"})

    def sync() -> None:     # each device the stage's work runs on
        for d in cuda:
            torch.cuda.synchronize(d)
    backward = getattr(torch.autograd.backward, "_gputrace_orig", torch.autograd.backward)
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in mod.buffers()]
    was_training = mod.training
    times: dict[int, tuple[list[float], list[float]]] = {s: ([], []) for s in sizes}
    inputs = {s: (_resized(kept.args, r, s), _resized(kept.kwargs, r, s)) for s in sizes}
    out: dict[str, Any] = {"stage": kept.stage_index, "rows": sizes}

    def once(s: int) -> tuple[float, float]:
        args, kwargs = _copy(inputs[s][0]), _copy(inputs[s][1])
        sync()
        t0 = time.perf_counter()
        y = mod(*args, **kwargs)
        sync()
        t1 = time.perf_counter()
        ys = [t for t in _tensors(y) if t.requires_grad]
        backward(ys, [torch.ones_like(t) for t in ys])
        sync()
        return t1 - t0, time.perf_counter() - t1

    split = _splitter(mod, inputs[r], sync)
    if isinstance(split, str):
        out["split_skipped"] = split
        split = None
    split_times: tuple[list[float], list[float]] = ([], [])

    start = time.perf_counter()
    try:
        with _quiet(mod), torch.random.fork_rng(devices=cuda), torch.enable_grad():
            mod.train(kept.training)
            for p in params:      # the steady state: a microbatch accumulating into them
                p.grad = torch.zeros_like(p)
            for s in sizes:
                once(s)
            split = _guarded(split, out)
            if split is not None and split() is None:
                split = None
            for _ in range(ROUNDS):
                for s in sizes:
                    f, b = once(s)
                    times[s][0].append(f)
                    times[s][1].append(b)
                got = split() if split is not None else None
                if got is not None:     # beside the fused backward at the recorded rows
                    split_times[0].append(got[0])
                    split_times[1].append(got[1])
                if time.perf_counter() - start > BUDGET_S:
                    out["stopped"] = f"after {len(times[sizes[0]][0])} rounds ({BUDGET_S:.0f} s)"
                    break
    except Exception as e:  # noqa: BLE001 - the probe says why, the job ends as it would
        out["failed"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        mod.train(was_training)
    if "failed" not in out:
        out["forward_s"] = [_lower_quartile(times[s][0]) for s in sizes]
        out["backward_s"] = [_lower_quartile(times[s][1]) for s in sizes]
        out["forward_rounds_s"] = [times[s][0] for s in sizes]
        out["backward_rounds_s"] = [times[s][1] for s in sizes]
        if split_times[0] and "split_skipped" not in out:
            out["input_s"] = _lower_quartile(split_times[0])
            out["weight_s"] = _lower_quartile(split_times[1])
            out["input_rounds_s"], out["weight_rounds_s"] = split_times
    return out


def _guarded(split: Any, out: dict[str, Any]) -> Any:
    """`split` whose failure ends the split's timing (None from then on, the reason in
    `out["split_skipped"]`), not the probe's."""
    if split is None:
        return None
    state = {"on": True}

    def run() -> tuple[float, float] | None:
        if not state["on"]:
            return None
        try:
            return split()
        except Exception as e:  # noqa: BLE001 - the fused figures stand without it
            state["on"] = False
            cause = e.__cause__ or e    # torch's split wraps the error in its own
            out["split_skipped"] = (f"{type(cause).__name__}: {cause}".strip().splitlines()
                                    or [""])[0][:200]
            return None
    return run


def _splitter(mod: Any, inputs: tuple[Any, Any], sync: Any) -> Any:
    """A function that runs the stage's forward and then its backward split as the
    zero-bubble schedules split it (torch.distributed.pipelining's stage_backward_input,
    then stage_backward_weight) on `inputs`, returning the two parts' seconds; or why it
    cannot (a string). The stage is timed as a stage with an upstream neighbour: its
    floating-point inputs take a gradient (a first stage's input part is empty under those
    schedules, its weight part the whole backward: the analysis knows that)."""
    try:
        import torch
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError as e:
        return f"this torch has no split backward ({e})"
    args, kwargs = inputs
    if not any(t.is_floating_point() for t in _tensors((args, kwargs))):
        return "no input of the stage takes a gradient (integer inputs: token ids)"

    def run() -> tuple[float, float]:
        a, k = _map((args, kwargs), lambda t: t.detach().clone().requires_grad_(
            t.requires_grad or t.is_floating_point()))
        y = mod(*a, **k)
        # torch's split detaches the outputs in place, which a view refuses: a copy of it
        ys = [t.clone() if t._is_view() else t for t in _tensors(y) if t.requires_grad]
        ins = [t for t in _tensors((a, k)) if t.requires_grad]
        sync()
        t0 = time.perf_counter()
        _, groups = stage_backward_input(ys, [torch.ones_like(t) for t in ys], ins,
                                         mod.parameters())
        sync()
        t1 = time.perf_counter()
        stage_backward_weight(mod.parameters(), groups)
        sync()
        return t1 - t0, time.perf_counter() - t1
    return run
