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

import gzip
import importlib.util
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gputrace.importers.common import ImportFailed, Rows

XPLANE_SUFFIX = ".xplane.pb"
TRACE_SUFFIXES = (".trace.json.gz", ".trace.json")

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


@dataclass
class Host:
    """The host events of one XPlane (or trace-viewer process), flattened: per thread
    (line) its name and events (metadata name, start ns, end ns, stats or None)."""

    lines: dict[int, str] = field(default_factory=dict)
    events: dict[int, list[tuple[str, int, int, dict[str, Any] | None]]] = \
        field(default_factory=dict)
    start_ns: int = 0
    hostname: str = ""


@dataclass
class Device:
    """GPU activity of one device plane: (line, name, start, end, stats) per event."""

    index: int
    events: list[tuple[int, str, int, int, dict[str, Any]]] = field(default_factory=list)


# -- reading ---------------------------------------------------------------------------------
def xplane_pb2() -> Any:
    """The XPlane schema as TensorFlow ships it (`tensorflow/tsl/profiler/protobuf/
    xplane_pb2.py`), loaded from its file: importing `tensorflow` itself takes seconds, the
    schema needs only protobuf."""
    import sys

    mod = sys.modules.get("tensorflow.tsl.profiler.protobuf.xplane_pb2")
    if mod is not None:
        return mod
    have = sys.modules.get("_gputrace_xplane_pb2")
    if have is not None:
        return have
    try:
        spec = importlib.util.find_spec("tensorflow")
    except (ImportError, ValueError):
        spec = None
    path = None
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = os.path.join(d, "tsl", "profiler", "protobuf", "xplane_pb2.py")
            if os.path.exists(p):
                path = p
    if path is None:
        raise ImportFailed("reading TensorFlow profiler output (.xplane.pb) needs TensorFlow's "
                           "XPlane schema: pip install 'gputrace[tf]' (or tensorflow)")
    try:
        s = importlib.util.spec_from_file_location("_gputrace_xplane_pb2", path)
        assert s is not None and s.loader is not None
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - protobuf missing or too old for the schema
        raise ImportFailed(f"TensorFlow's XPlane schema ({path}) does not load: "
                           f"{type(e).__name__}: {e}".splitlines()[0]) from None
    sys.modules["_gputrace_xplane_pb2"] = mod
    return mod


def _stat(plane: Any, st: Any) -> Any:
    kind = st.WhichOneof("value")
    if kind == "ref_value":
        return plane.stat_metadata[st.ref_value].name
    if kind == "bytes_value":
        return None
    return getattr(st, kind) if kind else None


def read_xspace(path: str) -> tuple[list[Host], list[Device]]:
    """The host planes and GPU planes of one `.xplane.pb` file."""
    pb = xplane_pb2()
    space = pb.XSpace()
    try:
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
    except OSError as e:
        raise ImportFailed(f"{path}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ImportFailed(f"{path}: not an XPlane protobuf ({type(e).__name__})") from None
    start = 0
    for plane in space.planes:
        if plane.name == "Task Environment":
            for st in plane.stats:
                if plane.stat_metadata[st.metadata_id].name == "profile_start_time":
                    start = int(_stat(plane, st) or 0)
    hosts, devices = [], []
    for plane in space.planes:
        if plane.name.startswith("/host:CPU"):
            h = Host(start_ns=start, hostname=space.hostnames[0] if space.hostnames else "")
            meta = {k: v.name for k, v in plane.event_metadata.items()}
            for line in plane.lines:
                h.lines[line.id] = line.name
                base = start + line.timestamp_ns
                evs = h.events.setdefault(line.id, [])
                for e in line.events:
                    name = meta.get(e.metadata_id, "")
                    t0 = base + e.offset_ps // 1000
                    stats = None
                    if e.stats and plane.stat_metadata[e.stats[0].metadata_id].name in \
                            ("tf_function_call", "step_num"):
                        stats = {plane.stat_metadata[x.metadata_id].name: _stat(plane, x)
                                 for x in e.stats}
                    evs.append((name, t0, t0 + e.duration_ps // 1000, stats))
            hosts.append(h)
        elif plane.name.startswith("/device:GPU:"):
            try:
                dev = Device(int(plane.name.rsplit(":", 1)[1]))
            except ValueError:
                continue
            meta = {k: v for k, v in plane.event_metadata.items()}
            for line in plane.lines:
                base = start + line.timestamp_ns
                for e in line.events:
                    md = meta.get(e.metadata_id)
                    stats = {plane.stat_metadata[s.metadata_id].name: _stat(plane, s)
                             for s in (*e.stats, *(md.stats if md is not None else ()))}
                    t0 = base + e.offset_ps // 1000
                    dev.events.append((line.id, md.name if md is not None else "", t0,
                                       t0 + e.duration_ps // 1000, stats))
            devices.append(dev)
    return hosts, devices


def read_trace_json(path: str) -> list[Host]:
    """The trace viewer's JSON (`*.trace.json.gz`, what TensorBoard's profile plugin and
    xprof serve): one Host per `/host:CPU` process, an op's full name from its stack frame;
    times are relative to the profile's start (the format has no clock anchor)."""
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        with (gzip.open(path, "rt") if gz else open(path)) as f:
            doc = json.load(f)
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as e:
        raise ImportFailed(f"{path}: not a TensorFlow trace-viewer JSON ({e})") from None
    evs = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(evs, list):
        raise ImportFailed(f"{path}: no 'traceEvents' list in it")
    procs: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    frames = doc.get("stackFrames") if isinstance(doc.get("stackFrames"), dict) else {}
    for ev in evs:
        if isinstance(ev, dict) and ev.get("ph") == "M":
            args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
            if ev.get("name") == "process_name":
                procs[ev.get("pid")] = str(args.get("name", ""))
            elif ev.get("name") == "thread_name":
                threads[(ev.get("pid"), ev.get("tid"))] = str(args.get("name", ""))
    hosts: dict[Any, Host] = {}
    for ev in evs:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        pid = ev.get("pid")
        if "/host:CPU" not in procs.get(pid, ""):
            continue
        ts, dur = ev.get("ts"), ev.get("dur", 0)
        if not isinstance(ts, int | float) or not isinstance(dur, int | float):
            continue
        h = hosts.setdefault(pid, Host())
        tid = ev.get("tid")
        key = tid if isinstance(tid, int) else hash(tid)
        h.lines.setdefault(key, threads.get((pid, tid), str(tid)))
        args = ev.get("args") if isinstance(ev.get("args"), dict) else None
        name = str(ev.get("name", ""))
        frame = frames.get(str(ev.get("sf"))) if "sf" in ev else None
        long = frame.get("name") if isinstance(frame, dict) else None
        if isinstance(long, str) and _is_op(long):
            name = long           # the op's full `scope/name:Type` (the JSON names its type)
        t0 = round(ts * 1000)
        h.events.setdefault(key, []).append((name, t0, t0 + max(round(dur * 1000), 0), args))
    if not hosts:
        raise ImportFailed(f"{path}: no '/host:CPU' events: not a TensorFlow trace")
    return list(hosts.values())


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


def _is_op(name: str) -> bool:
    return ":" in name and "::" not in name


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
            elif not _is_op(name):
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


# -- import ------------------------------------------------------------------------------------
def profile_files(path: str) -> list[str]:
    """The XPlane (else trace-viewer JSON) files of a TensorFlow log directory, a run
    directory or one file: `logdir/plugins/profile/RUN/*.xplane.pb`."""
    if not os.path.isdir(path):
        return [path]
    found: list[str] = []
    for root, _dirs, files in os.walk(path):
        found += [os.path.join(root, f) for f in files if f.endswith(XPLANE_SUFFIX)]
    if not found:
        for root, _dirs, files in os.walk(path):
            found += [os.path.join(root, f) for f in files if f.endswith(TRACE_SUFFIXES)]
    return sorted(found)


_RANK_IN_PATH = re.compile(r"(?:rank|worker|task)[-_]?(\d+)", re.IGNORECASE)


def ranks_of(files: list[str]) -> list[int]:
    """One rank per profile file: `rank<N>`, `worker<N>` or `task<N>` in its path when every
    file has a distinct one, else the files' order."""
    found = []
    for f in files:
        m = _RANK_IN_PATH.findall(f)
        found.append(int(m[-1]) if m else None)
    if None not in found and len(set(found)) == len(found):
        return [int(r) for r in found]   # type: ignore[arg-type]
    return list(range(len(files)))


def looks_like(path: str) -> bool:
    """A TensorFlow profile file, by name (XPlane) or content (trace-viewer JSON)."""
    if path.endswith(XPLANE_SUFFIX):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        with (gzip.open(path, "rb") if head == b"\x1f\x8b" else open(path, "rb")) as f:
            text = f.read(1 << 16)
    except (OSError, EOFError):
        return False
    return b'/host:CPU"' in text and b'"process_name"' in text


def is_profile_dir(path: str) -> bool:
    """A directory holding TensorFlow profiles (at any depth: a logdir, a run)."""
    return os.path.isdir(path) and bool(profile_files(path))


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
