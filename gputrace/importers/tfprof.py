"""TensorFlow profiler output -> trace v1 rows: XPlane protobuf (`*.xplane.pb`, what
`tf.profiler.experimental`, `keras.callbacks.TensorBoard(profile_batch=...)` and gputrace's
own TensorFlow collector write) and the trace viewer's JSON.

TensorFlow names every op of a graph `scope/.../name:Type`, so its phase follows from the
name: the input pipeline's wait (`IteratorGetNext...`) is `io` on the training loop's
thread, tf.data's own work (its threads) `io` elsewhere; ops under `gradient_tape/` or
`gradients/`, and gradient op types (`...Grad`, `...Backprop...`), are `backward`; ops under
the optimizer's scope (`sgd/`, `adam/`, ...) or applying updates (`ResourceApply...`) are
`update`; collectives (`CollectiveReduceV2`, `NcclAllReduce`, Horovod's) under the optimizer
or gradient scope are `comm` units (other collectives, such as the distributed iterator's
check that every worker has data, are `sync`); other ops of the step are `forward`.
Iterations are the training function's calls (a `tf.function` whose ops include gradients)
on the loop's thread, or TensorFlow's step markers (`step_num`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gputrace.importers.common import ImportFailed, Rows
from gputrace.importers.tfprof_files import (
    XPLANE_SUFFIX,
    Device,
    Host,
    is_op,
    read_trace_json,
    read_xspace,
)

# collectives: all-reduce of gradients when under the optimizer's or the gradients' scope
_COLLECTIVE = re.compile(r"^(Collective|Nccl|Horovod|_Horovod|HorovodAllreduce)|AllReduce|"
                         r"Allreduce|all-reduce", re.IGNORECASE)
_GRAD_TYPE = re.compile(r"(Grad(V\d)?$|GradGrad$|Backprop|^BroadcastGradientArgs$|"
                        r"GradWithArgmax$|^_FusedBatchNormGrad|^FusedBatchNormGrad)")
_UPDATE_TYPE = re.compile(r"^(Resource)?(Sparse)?Apply[A-Z]")
_BACKWARD_SCOPES = frozenset(("gradient_tape", "gradients"))
# the name scopes of Keras's and TensorFlow's optimizers
OPTIMIZER_SCOPES = frozenset((
    "sgd", "adam", "adamw", "adamax", "adagrad", "adadelta", "adafactor", "rmsprop", "nadam",
    "ftrl", "lion", "lamb", "lars", "muon", "loss_scale_optimizer", "lossscaleoptimizer",
    "optimizer", "gradientdescent", "momentum", "distributedoptimizer"))
_WRAPPERS = frozenset(("StatefulPartitionedCall", "PartitionedCall"))
_UNIQUE = re.compile(r"_\d+$")
# variable bookkeeping at the step function's top scope (no model, loss or optimizer scope)
_BOOKKEEPING = frozenset((
    "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "NoOp", "Identity", "IdentityN", "Const", "VarHandleOp", "_Arg", "_Retval", "Assert",
    "OptionalHasValue", "OptionalFromValue", "OptionalGetValue", "OptionalNone",
    "MultiDeviceIteratorFromStringHandle", "IteratorFromStringHandleV2", "RemoteCall"))
# the training loop waiting for its batch
_WAITS = ("IteratorGetNextOp::DoCompute", "IteratorGetNextAsOptionalOp::DoCompute",
          "MultiDeviceIteratorGetNextFromShardOp::DoCompute")
_WAIT_TYPES = frozenset(("IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
                         "MultiDeviceIteratorGetNextFromShard"))
# TensorFlow's own machinery, never a phase of the model
_INFRA = ("ThreadpoolListener::", "ExecutorState::", "ExecutorDoneCallback", "ParallelFor",
          "CollectiveExecutor::", "BaseCollectiveExecutor::", "CollectiveOpV2Kernel::",
          "TFE_", "Eager", "KernelAndDeviceFunc", "ValidateInputTypeAndPlacement",
          "FunctionRun", "InstantiatedCapturedFunction", "RemoteCallOp", "Loop")
_EAGER = "EagerLocalExecute: "


def op_phase(name: str, optimizers: Iterable[str] = ()) -> str | None:
    """The phase of a graph op named `scope/.../name:Type` (or of an eager op's type):
    io, backward, update, comm, sync (a collective that is not gradients), forward, or None
    (variable bookkeeping at the top scope)."""
    path, _, typ = name.rpartition(":")
    if not path:
        path, typ = typ, typ
    parts = path.split("/")
    while len(parts) > 1 and parts[0] in _WRAPPERS:
        parts = parts[1:]
    scopes = {p.lower() for p in parts[:-1]}
    # a scope made unique by the graph (`sgd_1`: a second optimizer named sgd) is still its
    opt = {_UNIQUE.sub("", p) for p in scopes} & \
        (OPTIMIZER_SCOPES | {o.lower() for o in optimizers}) or \
        any(p.startswith("update_") for p in scopes)
    grads = bool(scopes & _BACKWARD_SCOPES) or any(p.startswith("gradients_") for p in scopes)
    if _COLLECTIVE.search(typ):
        return "comm" if (opt or grads or "horovod" in typ.lower()) else "sync"
    if typ in _WAIT_TYPES:
        return "io"
    if grads or _GRAD_TYPE.search(typ):
        return "backward"
    if opt or _UPDATE_TYPE.match(typ):
        return "update"
    if len(parts) == 1 and typ in _BOOKKEEPING:
        return None
    return "forward"


# -- conversion ------------------------------------------------------------------------------
@dataclass
class Converted:
    """What `convert` found: iteration windows (start, end) and counts by phase."""

    iterations: list[tuple[int, int]]
    counts: dict[str, int]
    loop_line: int | None
    # where the loop's thread ran a compiled function's graph (its ops and their waits),
    # (start, end): outside them, the loop did the framework's own work
    executions: list[tuple[int, int]] = field(default_factory=list)


def _loop_line(h: Host) -> int | None:
    """The training loop's thread: the one that calls functions and eager ops."""
    best, score = None, 0
    for lid, evs in h.events.items():
        n = sum(1 for e in evs if e[0].startswith(("EagerExecute", _EAGER, "TFE_Py")))
        if n > score:
            best, score = lid, n
    if best is None:
        for lid, name in h.lines.items():
            if name in ("python", "MainThread", "python3"):
                return lid
    return best


def _merged(evs: list[tuple[int, int, str]]) -> Iterator[tuple[int, int, str]]:
    """Nested or overlapping intervals of one thread merged (first name kept)."""
    evs.sort()
    cur: list[Any] | None = None
    for s, e, n in evs:
        if cur is not None and s <= cur[1]:
            cur[1] = max(cur[1], e)
            continue
        if cur is not None:
            yield cur[0], cur[1], cur[2]
        cur = [s, e, n]
    if cur is not None:
        yield cur[0], cur[1], cur[2]


def op_key(name: str) -> str:
    """A profiled op's name as its graph names it: `scope/name`, without the type and the
    function-call wrappers around it."""
    path = name.rpartition(":")[0] or name
    parts = path.split("/")
    while len(parts) > 1 and parts[0] in _WRAPPERS:
        parts = parts[1:]
    return "/".join(parts)


def convert(h: Host, rows: Rows, *, rank: int, pid: int, loop_tid: int | None = None,
            optimizers: Iterable[str] = (), eager: bool = True, host: str = "",
            iterations: bool = True, windows: list[tuple[int, int]] | None = None,
            comm_bytes: dict[str, int] | None = None) -> Converted:
    """Append the phases of one host's profile to `rows`.

    loop_tid: the tid to write the loop's thread as (gputrace's own loop thread when
    recording; else TensorFlow's line id); eager: convert the loop thread's eager ops by
    their type (off when gputrace's hooks timed the eager phases themselves); iterations:
    write the training function's calls as iterations; windows: the iterations (start, end)
    known from elsewhere, for numbering each one's comm units; comm_bytes: the bytes each
    collective op reduces, by its graph name (`op_key`), where the profile has none."""
    optimizers = tuple(optimizers)
    loop = _loop_line(h)
    ltid = loop_tid if loop_tid is not None else (loop if loop is not None else -1)
    counts: dict[str, int] = {}
    base = dict(rank=rank, pid=pid, host=host) if host else dict(rank=rank, pid=pid)
    phase_cache: dict[str, str | None] = {}
    consumer_lines = {lid for lid, evs in h.events.items()
                      if any(e[0] in _WAITS for e in evs)}
    marks: list[tuple[int, int, int]] = []     # (start, end, step) of step markers
    calls: list[tuple[int, int]] = []          # tf.function calls on the loop's thread
    backward_at: list[int] = []
    executions: list[tuple[int, int]] = []     # a compiled function's graph running
    comm: list[tuple[int, int]] = []           # (start, row) of gradient collectives
    for lid, evs in h.events.items():
        lname = h.lines.get(lid, "")
        tid = ltid if lid == loop else lid
        if lname.startswith("tf_data") and lid not in consumer_lines:
            work = [(s, e, n) for n, s, e, _ in evs if not n.startswith(_INFRA)]
            for s, e, n in _merged(work):
                rows.add("span", "io", n, s, e, tid=lid, step=-1, **base)
                counts["io_work"] = counts.get("io_work", 0) + 1
            continue
        for name, s, e, stats in evs:
            if name in _WAITS:
                rows.add("span", "io", name.split("Op::")[0], s, e, tid=ltid, **base)
                counts["io"] = counts.get("io", 0) + 1
                continue
            if stats and lid == loop:
                if "step_num" in stats and isinstance(stats["step_num"], int):
                    marks.append((s, e, int(stats["step_num"])))
                elif "tf_function_call" in stats:
                    calls.append((s, e))
                continue
            if name.startswith(_EAGER):
                if lid == loop and name.startswith("__inference_", len(_EAGER)):
                    executions.append((s, e))
                    continue
                if not eager or lid != loop:
                    continue
                name = name[len(_EAGER):]
                if name.startswith("__inference_"):
                    continue
            elif not is_op(name):
                continue
            ph = phase_cache.get(name, "?")
            if ph == "?":
                ph = phase_cache[name] = op_phase(name, optimizers)
            if ph is None:
                continue
            if ph == "backward":
                backward_at.append(s)
            if ph == "io":      # an IteratorGetNext op itself (its wait is on the loop)
                rows.add("span", "io", name, s, e, tid=ltid, **base)
            elif ph == "comm":
                nb = comm_bytes.get(op_key(name)) if comm_bytes else None
                comm.append((s, rows.add("span", "comm", name, s, e, tid=tid, bytes=nb,
                                         **base)))
            else:
                rows.add("span", ph, name, s, e, tid=tid, **base)
            counts[ph] = counts.get(ph, 0) + 1
    its: list[tuple[int, int]] = []
    if iterations:
        its = _iterations(marks, calls, backward_at)
        for k, (s, e) in enumerate(its):
            rows.add("span", "iteration", "iteration", s, e, tid=ltid, step=k, **base)
    number_units(rows, comm, its if windows is None else windows)
    counts["iterations"] = len(its)
    return Converted(its, counts, loop, executions)


def number_units(rows: Rows, comm: list[tuple[int, int]], its: list[tuple[int, int]]) -> None:
    """Each comm unit's `layer`: its index in launch order within its iteration."""
    if not comm or not its:
        return
    import numpy as np

    comm.sort()
    starts = np.array([s for s, _ in its], dtype=np.int64)
    order = np.argsort(starts)
    k = np.searchsorted(starts[order], np.array([s for s, _ in comm], np.int64), "right") - 1
    idx, n = [], []
    last, count = None, 0
    for (_, row), it in zip(comm, k.tolist(), strict=True):
        count = count + 1 if it == last else 0
        last = it
        idx.append(row)
        n.append(count if it >= 0 else -1)
    rows.set_many("layer", np.array(idx, np.int64), n)


def _iterations(marks: list[tuple[int, int, int]], calls: list[tuple[int, int]],
                backward_at: list[int]) -> list[tuple[int, int]]:
    """Step markers when the profile has them; else the loop's function calls that ran
    gradients, each from its start to the next one's (iterations tile the loop)."""
    import numpy as np

    if marks:
        marks.sort()
        return [(s, e) for s, e, _ in marks]
    if not calls or not backward_at:
        return []
    calls.sort()
    bt = np.sort(np.array(backward_at, dtype=np.int64))
    # top-level calls only (a function calling another is one call)
    top: list[tuple[int, int]] = []
    for s, e in calls:
        if top and s < top[-1][1]:
            continue
        top.append((s, e))
    train = [(s, e) for s, e in top
             if np.searchsorted(bt, e, "right") > np.searchsorted(bt, s, "left")]
    out = []
    for k, (s, e) in enumerate(train):
        nxt = train[k + 1][0] if k + 1 < len(train) else None
        out.append((s, nxt if nxt is not None and nxt >= e else e))
    return out


def gpu_rows(dev: Device, rows: Rows, *, rank: int, optimizers: Iterable[str] = ()) -> int:
    """Kernels and copies of one GPU plane, each with the phase of the TensorFlow op it ran
    for (its `tf_op` stat); NCCL kernels are comm. Returns the rows added."""
    n = 0
    for line, name, s, e, st in dev.events:
        op = st.get("tf_op")
        details = str(st.get("memcpy_details", ""))
        if "memcpy" in name.lower() or details:
            kind = details.lower()
            src, dst = (("pageable", "device") if "htod" in kind.replace("h2d", "htod")
                        else ("device", "pageable") if "dtoh" in kind.replace("d2h", "dtoh")
                        else (None, None))
            nb = st.get("num_bytes") or st.get("bytes")
            ph = "h2d" if src == "pageable" else (op_phase(op, optimizers) if op else None)
            rows.add("span", "memcpy", name, s, e, rank=rank, pid=-1, tid=-1,
                     device=dev.index, stream=line, src_kind=src, dst_kind=dst,
                     bytes=int(nb) if isinstance(nb, int) else None, phase=ph,
                     corr=st.get("correlation_id"))
        elif name.lower().startswith("nccl"):
            rows.add("span", "comm", name, s, e, rank=rank, pid=-1, tid=-1, device=dev.index,
                     stream=line, phase="comm", corr=st.get("correlation_id"))
        else:
            ph = op_phase(str(op), optimizers) if isinstance(op, str) and op else None
            rows.add("span", "kernel", name, s, e, rank=rank, pid=-1, tid=-1,
                     device=dev.index, stream=line, phase=ph, corr=st.get("correlation_id"))
        n += 1
    return n


def read(path: str, rank: int, rows: Rows) -> dict[str, Any]:
    """Append one profile file (XPlane or trace-viewer JSON) as `rank`."""
    if path.endswith(XPLANE_SUFFIX):
        hosts, devices = read_xspace(path)
    else:
        hosts, devices = read_trace_json(path), []
    if not hosts:
        raise ImportFailed(f"{path}: no host plane ('/host:CPU') in it")
    counts: dict[str, int] = {}
    for i, h in enumerate(hosts):
        c = convert(h, rows, rank=rank, pid=i + 1, host=h.hostname)
        for k, v in c.counts.items():
            counts[k] = counts.get(k, 0) + v
    for d in devices:
        counts["gpu"] = counts.get("gpu", 0) + gpu_rows(d, rows, rank=rank)
    return counts
