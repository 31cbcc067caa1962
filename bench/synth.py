"""Synthetic traces with a realistic shape, as gputrace Arrow and as the equivalent Kineto JSON.

Per rank and iteration: the host loop (iteration, io wait, forward, backward, update), GPU
kernels on three streams attributed to those phases, NCCL all-reduce kernels on a comm
stream overlapping the backward pass, memcpy H2D of the batch, and NVML/host samples.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa

from gputrace.trace.schema import COLUMNS
from gputrace.trace.writer import TraceWriter

MS = 1_000_000
KERNELS_PER_ITER = 200      # forward 70, backward 120, update 10
COMM_PER_ITER = 8
T0 = 1_750_000_000 * 10**9


def shape(events: int, ranks: int = 4) -> int:
    """Iterations per rank to reach about `events` events."""
    per_iter = 5 + KERNELS_PER_ITER + COMM_PER_ITER + 1 + 4  # host, kernels, comm, memcpy, samples
    return max(1, math.ceil(events / ranks / per_iter))


def rank_events(rank: int, iters: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + rank)
    it_len = 100 * MS
    stagger = (rank % 16) * 37_000    # ranks start their iterations a little apart
    base = T0 + np.arange(iters, dtype=np.int64) * it_len + stagger
    cols: dict[str, list[np.ndarray]] = {k: [] for k in
                                         ("cat", "phase", "start", "end", "device", "stream",
                                          "step", "bytes", "tid", "kind", "name", "value")}

    def add(cat, phase, start, end, device, stream, step, nbytes=None, tid=-1, kind=0,
            name=0, value=None):
        n = start.size
        cols["cat"].append(np.full(n, cat, np.int8))
        cols["phase"].append(np.full(n, phase, np.int8))
        cols["start"].append(start)
        cols["end"].append(end)
        cols["device"].append(np.full(n, device, np.int16))
        cols["stream"].append(np.broadcast_to(np.asarray(stream, np.int32), (n,)).copy())
        cols["step"].append(step.astype(np.int32))
        cols["bytes"].append(np.full(n, -1, np.int64) if nbytes is None else nbytes)
        cols["tid"].append(np.full(n, tid, np.int64))
        cols["kind"].append(np.full(n, kind, np.int8))
        cols["name"].append(np.broadcast_to(np.asarray(name, np.int16), (n,)).copy())
        cols["value"].append(np.full(n, np.nan) if value is None else value)

    steps = np.arange(iters)
    # host phases (cat codes: see CATS)
    for cat, a, b in ((0, 0, 100), (1, 0, 5), (3, 5, 30), (4, 30, 85), (5, 88, 98)):
        add(cat, -1, base + a * MS, base + b * MS, -1, -1, steps, tid=1)
    # kernels: forward 5..30, backward 30..85, update 88..98, 3 streams
    for phase, n, a, b in ((3, 70, 5, 30), (4, 120, 30, 85), (5, 10, 88, 98)):
        k = np.repeat(base, n) + ((np.tile(np.arange(n), iters) / n) * (b - a) + a) * MS
        k = k.astype(np.int64) + rng.integers(0, 50_000, k.size)
        d = (b - a) * MS // n
        add(6, phase, k, k + d * 9 // 10, rank % 8, rng.integers(7, 10, k.size),
            np.repeat(steps, n), name=rng.integers(1, 40, k.size))
    # NCCL all-reduce buckets during backward, on the comm stream
    c = np.repeat(base, COMM_PER_ITER) + ((np.tile(np.arange(COMM_PER_ITER), iters) * 7
                                           + 40) * MS)
    # (a collective ends on every rank at once: the last to arrive releases them all)
    add(7, 7, c, c - stagger + 6 * MS, rank % 8, 20, np.repeat(steps, COMM_PER_ITER),
        nbytes=np.full(c.size, 25 << 20, np.int64), name=40)
    # H2D of the batch
    add(8, 2, base + 1 * MS, base + 4 * MS, rank % 8, 7, steps,
        nbytes=np.full(iters, 64 << 20, np.int64), name=41)
    # samples: 4 per iteration (pcie rx counter rising)
    ts = np.repeat(base, 4) + np.tile(np.arange(4), iters) * 25 * MS
    add(9, -1, ts, np.full(ts.size, -1, np.int64), rank % 8, -1, np.full(ts.size, -1),
        kind=1, name=42, value=np.cumsum(np.full(ts.size, 16e6)))
    out = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.argsort(out["start"], kind="stable")
    return {k: v[order] for k, v in out.items()}


CATS = ["iteration", "io", "h2d", "forward", "backward", "update", "kernel", "comm", "memcpy",
        "pcie"]
PHASES = [None, None, "h2d", "forward", "backward", "update", None, "comm"]
NAMES = ["", *[f"void kernel_{i}<float>(float*, int)" for i in range(1, 40)],
         "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "Memcpy HtoD (Pinned -> Device)",
         "pcie.rx_bytes"]


def write_arrow(path: Path, events: int, ranks: int = 4, shards: bool = False) -> int:
    """The events as one trace file; with `shards`, `path` is a directory that gets one file
    per rank in small batches, as a recording's processes leave them before the merge."""
    iters = shape(events, ranks)
    md = {"host": "bench", "world_size": ranks, "role": "record"}
    if not shards:
        return _write(TraceWriter(path, md), range(ranks), iters, "bench", 1 << 20)
    n = 0
    for r in range(ranks):
        n += _write(TraceWriter(path / f"rank{r}.arrow", dict(md, role="process", rank=r)),
                    [r], iters, "bench", 1 << 16)
    return n


def write_nodes(directory: Path, events: int, ranks: int, per_node: int = 8,
                name: str = "run") -> int:
    """The events of a multi-node recording: one file per node of `per_node` ranks
    (`run.nodeK.arrow`, each a part of `run.arrow`), as `record` writes them on each node."""
    iters = shape(events, ranks)
    directory.mkdir(parents=True, exist_ok=True)
    n = 0
    for k in range(math.ceil(ranks / per_node)):
        host = f"node{k:04d}"
        md = {"host": host, "world_size": ranks, "role": "record", "node_of": f"{name}.arrow"}
        n += _write(TraceWriter(directory / f"{name}.{host}.arrow", md),
                    range(k * per_node, min((k + 1) * per_node, ranks)), iters, host, 1 << 20)
    return n


def _write(w: TraceWriter, ranks, iters: int, host: str, batch: int) -> int:
    """Write the ranks' events, sorted by rank, one rank per record batch; close."""
    n = 0
    host_names = {0: "iteration", 1: "io", 3: "forward", 4: "backward", 5: "update"}
    for r in ranks:
        e = rank_events(r, iters)
        cat = np.array(CATS, dtype=object)[e["cat"]]
        phase = np.array(PHASES + [None] * 3, dtype=object)[np.clip(e["phase"], 0, 9)]
        phase[e["phase"] < 0] = None
        name = np.array(NAMES, dtype=object)[e["name"]]
        on_host = e["device"] < 0
        name[on_host] = [host_names[c] for c in e["cat"][on_host]]
        kind = np.where(e["kind"] == 1, "sample", "span").astype(object)
        nb = e["bytes"]
        for lo in range(0, e["start"].size, batch):
            sl = slice(lo, lo + batch)
            m = e["start"][sl].size
            d = {
                "kind": kind[sl], "cat": cat[sl], "name": name[sl], "start_ns": e["start"][sl],
                "end_ns": pa.array(e["end"][sl], mask=e["end"][sl] < 0),
                "value": pa.array(e["value"][sl], mask=np.isnan(e["value"][sl])),
                "unit": np.where(e["kind"][sl] == 1, "bytes", None).astype(object),
                "host": pa.DictionaryArray.from_arrays(np.zeros(m, np.int32), [host]),
                "rank": np.full(m, r, np.int32),
                "pid": np.full(m, 1000 + r, np.int32), "tid": e["tid"][sl],
                "device": e["device"][sl], "stream": e["stream"][sl], "step": e["step"][sl],
                "layer": np.full(m, -1, np.int32),
                "bytes": pa.array(nb[sl], mask=nb[sl] < 0),
                "src_kind": np.where(e["cat"][sl] == 8, "pinned", None).astype(object),
                "dst_kind": np.where(e["cat"][sl] == 8, "device", None).astype(object),
                "corr": pa.nulls(m, pa.int64()), "args": pa.nulls(m, pa.string()),
                "phase": phase[sl],
                # GPU records: launched 20 us before they ran (the analysis takes the
                # iteration of the launch)
                "launch_ns": pa.array(e["start"][sl] - 20_000,
                                      mask=(e["device"][sl] < 0) | (e["kind"][sl] == 1)),
            }
            arrays = [pa.array(d[name], typ.value_type if pa.types.is_dictionary(typ) else typ)
                      if not isinstance(d[name], pa.Array) else d[name].cast(
                          typ.value_type if pa.types.is_dictionary(typ) else typ)
                      for name, typ, _, _ in COLUMNS]
            w.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(
                [pa.field(nm, a.type) for (nm, _, _, _), a in zip(COLUMNS, arrays, strict=True)])))
            n += m
    w.close()
    return n


def write_kineto(directory: Path, events: int, ranks: int = 4, gz: bool = False) -> int:
    """The same events as one Kineto JSON per rank (what the PyTorch profiler writes), with a
    cudaLaunchKernel runtime event beside each GPU event as Kineto writes it."""
    iters = shape(events, ranks)
    directory.mkdir(parents=True, exist_ok=True)
    n = 0
    host_names = {0: "ProfilerStep#", 1: "enumerate(DataLoader)#_MultiProcessingDataLoaderIter"
                  ".__next__", 3: "## forward ##", 4: "## backward ##",
                  5: "Optimizer.step#SGD.step"}
    for r in range(ranks):
        e = rank_events(r, iters)
        path = directory / f"rank{r}.json" if not gz else directory / f"rank{r}.json.gz"
        opener = gzip.open if gz else open
        with opener(path, "wt") as f:
            head = {"schemaVersion": 1,
                    "distributedInfo": {"backend": "nccl", "rank": r, "world_size": ranks}}
            f.write(json.dumps(head)[:-1] + ',"traceEvents":[\n')
            first = True
            for i in range(e["start"].size):
                c = int(e["cat"][i])
                ts = (int(e["start"][i]) - T0) / 1000 + (T0 // 1000)
                if c == 9:
                    ev = {"ph": "C", "name": "pcie.rx_bytes", "pid": r, "ts": ts,
                          "args": {"value": float(e["value"][i])}}
                else:
                    dur = (int(e["end"][i]) - int(e["start"][i])) / 1000
                    if c in host_names:
                        name = host_names[c] + (str(int(e["step"][i])) if c == 0 else "")
                        ev = {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1000 + r,
                              "tid": 1, "ts": ts, "dur": dur, "args": {}}
                    else:
                        cat = {6: "kernel", 7: "kernel", 8: "gpu_memcpy"}[c]
                        ev = {"ph": "X", "cat": cat, "name": NAMES[int(e["name"][i])],
                              "pid": int(e["device"][i]), "tid": int(e["stream"][i]), "ts": ts,
                              "dur": dur, "args": {"device": int(e["device"][i]),
                                                   "stream": int(e["stream"][i]),
                                                   "correlation": i}}
                        if c == 8:
                            ev["args"]["bytes"] = int(e["bytes"][i])
                        # the launch on the host: Kineto (and HTA) tie kernels to it
                        f.write(",\n" + json.dumps(
                            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                             "pid": 1000 + r, "tid": 1, "ts": ts - 20, "dur": 5,
                             "args": {"correlation": i, "External id": i}},
                            separators=(",", ":")))
                f.write(("" if first else ",\n") + json.dumps(ev, separators=(",", ":")))
                first = False
                n += 1
            f.write("\n]}\n")
    return n


# the raw columnar scan the analysis is held against: every trace file of a directory, two
# columns read (the projection in the reader), the spans' durations summed; run as
# `python -c SCAN DIR`: every file read, two columns of it, summed
SCAN = """import sys, glob, pyarrow as pa, pyarrow.compute as pc
names = sys.argv[2].split(',') if len(sys.argv) > 2 else ['start_ns', 'end_ns']
total = 0
for f in sorted(glob.glob(sys.argv[1] + '/*.arrow')):
    with pa.OSFile(f) as src:
        schema = pa.ipc.open_file(src).schema
        at = [schema.get_field_index(c) for c in names if c in schema.names]
        t = pa.ipc.open_file(src, options=pa.ipc.IpcReadOptions(included_fields=at)).read_all()
        total += pc.sum(pc.subtract(t.column('end_ns'), t.column('start_ns'))).as_py()
print(total)
"""
