"""TensorFlow profiler files as gputrace reads them: the XPlane protobuf (`*.xplane.pb`, read
with TensorFlow's own schema) and the trace viewer's JSON, flattened to host threads and GPU
planes; and where a log directory keeps them, one rank per file."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from gputrace.importers.common import ImportFailed

XPLANE_SUFFIX = ".xplane.pb"
TRACE_SUFFIXES = (".trace.json.gz", ".trace.json")


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
        if isinstance(long, str) and is_op(long):
            name = long           # the op's full `scope/name:Type` (the JSON names its type)
        t0 = round(ts * 1000)
        h.events.setdefault(key, []).append((name, t0, t0 + max(round(dur * 1000), 0), args))
    if not hosts:
        raise ImportFailed(f"{path}: no '/host:CPU' events: not a TensorFlow trace")
    return list(hosts.values())


def is_op(name: str) -> bool:
    return ":" in name and "::" not in name


# -- finding the files ----------------------------------------------------------------------
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
