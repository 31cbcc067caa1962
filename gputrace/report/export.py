"""Timelines for viewers: Perfetto protobuf (ui.perfetto.dev) and Chrome Trace Event JSON.

Tracks: per rank a process; in it one track per host thread (`pid/tid`) and one per GPU
stream (`GPU d stream s`); samples become counter tracks (`name` or `name@GPU d`). A
pipeline-parallel rank's `pipeline` spans (its schedule steps, each microbatch's forward
and backward on its stage) get a track of their own, `pipeline stage S`, beside the
thread that ran them.
Spans that overlap without nesting on one thread go to extra lanes of that thread, so
every track's slices nest as the formats require. A collective's slice carries its kind,
bytes, process group (its DeviceMesh dimension), the parallelism it serves (`parallelism`:
dp, fsdp, tp, pp, ep, cp, as `analyze` classifies it), who issued it (a pipeline stage's
send/recv: `pp_stage`; DTensor: `issuer`) and, under FSDP, its unit, role and prefetch; the
job's wait on it is a slice nested in it (`wait: <kind>`, cat `comm_wait`).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.report.export_args import json_args, label, slice_args


class ExportUnavailable(Exception):
    """The chosen format needs an optional package that is not installed."""


@dataclass
class _Track:
    key: tuple[Any, ...]
    rank: int
    name: str
    spans: list[int]   # row indices, nesting


def _columns(table: pa.Table) -> dict[str, Any]:
    def np_(name: str, fill: int = -1) -> np.ndarray:
        return table.column(name).fill_null(fill).to_numpy()

    cols = {
        "kind": table.column("kind").cast(pa.string()).to_pylist(),
        "cat": table.column("cat").cast(pa.string()).to_pylist(),
        "name": table.column("name").cast(pa.string()).to_pylist(),
        "start": np_("start_ns", 0), "end": np_("end_ns"),
        "value": table.column("value").fill_null(float("nan")).to_numpy(),
        "rank": np_("rank"), "pid": np_("pid"), "tid": np_("tid"), "device": np_("device"),
        "stream": np_("stream"), "step": np_("step"), "layer": np_("layer"),
        "phase": table.column("phase").cast(pa.string()).to_pylist()
        if "phase" in table.column_names else [None] * table.num_rows,
        "bytes": np_("bytes"),
        "args": table.column("args").cast(pa.string()).to_pylist()
        if "args" in table.column_names else [None] * table.num_rows,
    }
    return _with_waits(cols)


def _with_waits(cols: dict[str, Any]) -> dict[str, Any]:
    """Append a row per collective the job waited on: its wait, inside the collective's
    slice on the same thread (clipped to it, so that it nests)."""
    extra: list[tuple[int, int, int]] = []    # (row, start, end)
    for i, (cat, raw) in enumerate(zip(cols["cat"], cols["args"], strict=True)):
        if cat != "comm" or not raw or '"wait"' not in raw or cols["kind"][i] != "span":
            continue
        try:
            w = json.loads(raw).get("wait")
            ws, we = int(w[0]), int(w[1])
        except (ValueError, TypeError, IndexError, AttributeError):
            continue
        s, e = int(cols["start"][i]), int(cols["end"][i])
        a, b = max(ws, s), min(we, e) if e >= 0 else we
        if b > a:
            extra.append((i, a, b))
    if not extra:
        return cols
    rows = [i for i, _, _ in extra]
    out = dict(cols)
    for k, v in cols.items():
        if isinstance(v, np.ndarray):
            out[k] = np.concatenate([v, v[rows]])
        else:
            out[k] = v + [v[i] for i in rows]
    n = len(cols["kind"])
    out["start"][n:] = [a for _, a, _ in extra]
    out["end"][n:] = [b for _, _, b in extra]
    out["cat"][n:] = ["comm_wait"] * len(extra)
    out["name"][n:] = [f"wait: {cols['name'][i]}" for i in rows]
    out["args"][n:] = [None] * len(extra)
    out["bytes"][n:] = -1
    return out


def _lanes(idx: list[int], start: np.ndarray, end: np.ndarray) -> list[list[int]]:
    """Split spans into lanes in which they nest (greedy, in start order)."""
    idx = sorted(idx, key=lambda i: (start[i], -end[i]))
    lanes: list[list[int]] = []
    stacks: list[list[int]] = []
    for i in idx:
        s, e = start[i], max(end[i], start[i])
        for lane, stack in zip(lanes, stacks, strict=True):
            while stack and stack[-1] <= s:
                stack.pop()
            if not stack or stack[-1] >= e:
                lane.append(i)
                stack.append(e)
                break
        else:
            lanes.append([i])
            stacks.append([e])
    return lanes


def tracks(cols: dict[str, Any]) -> tuple[list[_Track], dict[tuple[int, str], list[int]]]:
    """Span tracks (nesting) and counter series keyed (rank, name)."""
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    counters: dict[tuple[int, str], list[int]] = defaultdict(list)
    stages: dict[int, set[str]] = defaultdict(set)
    for i, kind in enumerate(cols["kind"]):
        rank = int(cols["rank"][i])
        if kind == "span":
            dev = int(cols["device"][i])
            if dev >= 0:
                groups[(rank, "gpu", dev, int(cols["stream"][i]))].append(i)
            elif cols["cat"][i] == "pipeline":
                groups[(rank, "pipeline", 0, 0)].append(i)
                st = json_args(cols, i).get("stage" if cols["name"][i] != "step"
                                             else "stages")
                stages[rank].update(str(x) for x in (st if isinstance(st, list) else [st])
                                    if isinstance(x, int))
            else:
                groups[(rank, "cpu", int(cols["pid"][i]), int(cols["tid"][i]))].append(i)
        elif kind == "sample" and cols["value"][i] == cols["value"][i]:
            dev = int(cols["device"][i])
            name = cols["name"][i] + (f"@GPU {dev}" if dev >= 0 else "")
            counters[(rank, name)].append(i)
    out: list[_Track] = []
    for key in sorted(groups):
        rank, where, a, b = key
        st = sorted(stages.get(rank, ()), key=int)
        base = f"GPU {a} stream {b}" if where == "gpu" else f"{a}/{b}" if where == "cpu" \
            else f"pipeline stage{'s' if len(st) > 1 else ''} {', '.join(st)}".rstrip()
        lanes = _lanes(groups[key], cols["start"], cols["end"])
        for n, lane in enumerate(lanes):
            out.append(_Track(key + (n,), rank, base if n == 0 else f"{base} ({n + 1})", lane))
    return out, counters


def write(trace: Any, path: str, fmt: str) -> dict[str, int]:
    cols = _columns(trace.table)
    span_tracks, counters = tracks(cols)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        if fmt == "chrome":
            counts = _write_chrome(tmp, cols, span_tracks, counters)
        else:
            counts = _write_perfetto(tmp, cols, span_tracks, counters)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return counts


def _proc_name(rank: int) -> str:
    return f"rank {rank}" if rank >= 0 else "process (not distributed)"


def _write_chrome(path: str, cols: dict[str, Any], span_tracks: list[_Track],
                  counters: dict[tuple[int, str], list[int]]) -> dict[str, int]:
    t0 = int(min([cols["start"].min()] if len(cols["start"]) else [0]))

    def us(ns: int) -> float:
        return (int(ns) - t0) / 1000.0

    def events() -> Iterator[dict[str, Any]]:
        ranks = sorted({t.rank for t in span_tracks} | {r for r, _ in counters})
        for r in ranks:
            yield {"ph": "M", "name": "process_name", "pid": r + 1, "tid": 0,
                   "args": {"name": _proc_name(r)}}
        for n, t in enumerate(span_tracks):
            tid = n + 1
            yield {"ph": "M", "name": "thread_name", "pid": t.rank + 1, "tid": tid,
                   "args": {"name": t.name}}
            for i in t.spans:
                yield {"ph": "X", "name": label(cols, i), "cat": cols["cat"][i],
                       "pid": t.rank + 1, "tid": tid, "ts": us(cols["start"][i]),
                       "dur": max(us(cols["end"][i]) - us(cols["start"][i]), 0.0)
                       if cols["end"][i] >= 0 else 0.0, "args": slice_args(cols, i)}
        for (r, name), idx in sorted(counters.items()):
            for i in idx:
                yield {"ph": "C", "name": name, "pid": r + 1, "ts": us(cols["start"][i]),
                       "args": {"value": float(cols["value"][i])}}

    with open(path, "w") as f:
        f.write('{"displayTimeUnit":"ms","otherData":{"source":"gputrace","t0_realtime_ns":'
                f'{t0}}},"traceEvents":[\n')
        first = True
        for ev in events():
            f.write(("" if first else ",\n") + json.dumps(ev, separators=(",", ":")))
            first = False
        f.write("\n]}\n")
    return {"tracks": len(span_tracks) + len(counters),
            "slices": sum(len(t.spans) for t in span_tracks),
            "counters": sum(len(v) for v in counters.values())}


def _write_perfetto(path: str, cols: dict[str, Any], span_tracks: list[_Track],
                    counters: dict[tuple[int, str], list[int]]) -> dict[str, int]:
    try:
        from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import (
            TracePacket,
            TrackEvent,
        )
        from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder
    except ImportError:
        raise ExportUnavailable("the Perfetto format needs the 'perfetto' package: "
                                "pip install 'gputrace[export]' (or use --format chrome)") \
            from None
    seq = 1
    uuid = iter(range(1, 1 << 62))
    with open(path, "wb") as f:
        b = StreamingTraceProtoBuilder(f)

        def packet() -> Any:
            p = b.create_packet()
            p.trusted_packet_sequence_id = seq
            return p

        first = packet()
        first.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        first.timestamp = int(cols["start"].min()) if len(cols["start"]) else 0
        b.write_packet(first)
        procs: dict[int, int] = {}
        ranks = sorted({t.rank for t in span_tracks} | {r for r, _ in counters})
        for r in ranks:
            procs[r] = next(uuid)
            p = packet()
            p.track_descriptor.uuid = procs[r]
            p.track_descriptor.process.pid = r + 1
            p.track_descriptor.process.process_name = _proc_name(r)
            b.write_packet(p)
        for t in span_tracks:
            u = next(uuid)
            p = packet()
            p.track_descriptor.uuid = u
            p.track_descriptor.parent_uuid = procs[t.rank]
            p.track_descriptor.name = t.name
            b.write_packet(p)
            # begin/end in time order, ends first at equal times so siblings do not nest;
            # _balanced then closes slices in stack order
            evs: list[tuple[int, int, int]] = []
            for i in t.spans:
                s = int(cols["start"][i])
                evs.append((s, 1, i))
                evs.append((max(int(cols["end"][i]), s), 0, i))
            evs.sort(key=lambda x: (x[0], x[1]))
            evs = _balanced(evs, cols)
            for ts, is_begin, i in evs:
                p = packet()
                p.timestamp = ts
                p.track_event.track_uuid = u
                if is_begin:
                    p.track_event.type = TrackEvent.TYPE_SLICE_BEGIN
                    p.track_event.name = label(cols, i)
                    p.track_event.categories.append(cols["cat"][i])
                    for k, v in slice_args(cols, i).items():
                        a = p.track_event.debug_annotations.add()
                        a.name = k
                        if isinstance(v, bool):
                            a.bool_value = v
                        elif isinstance(v, int):
                            a.int_value = v
                        else:
                            a.string_value = str(v)
                else:
                    p.track_event.type = TrackEvent.TYPE_SLICE_END
                b.write_packet(p)
        for (r, name), idx in sorted(counters.items()):
            u = next(uuid)
            p = packet()
            p.track_descriptor.uuid = u
            p.track_descriptor.parent_uuid = procs[r]
            p.track_descriptor.name = name
            p.track_descriptor.counter.SetInParent()
            b.write_packet(p)
            for i in idx:
                p = packet()
                p.timestamp = int(cols["start"][i])
                p.track_event.track_uuid = u
                p.track_event.type = TrackEvent.TYPE_COUNTER
                p.track_event.double_counter_value = float(cols["value"][i])
                b.write_packet(p)
    return {"tracks": len(span_tracks) + len(counters),
            "slices": sum(len(t.spans) for t in span_tracks),
            "counters": sum(len(v) for v in counters.values())}


def _balanced(evs: list[tuple[int, int, int]], cols: dict[str, Any]) -> list[tuple[int, int, int]]:
    """Order begin/end events so each end closes the innermost open slice (stack order)."""
    out: list[tuple[int, int, int]] = []
    stack: list[int] = []
    pending_ends: set[int] = set()
    for ts, is_begin, i in evs:
        if is_begin:
            stack.append(i)
            out.append((ts, 1, i))
            continue
        pending_ends.add(i)
        while stack and stack[-1] in pending_ends:
            j = stack.pop()
            pending_ends.discard(j)
            out.append((ts, 0, j))
    for j in reversed(stack):
        out.append((int(max(cols["end"][j], cols["start"][j])), 0, j))
    return out
