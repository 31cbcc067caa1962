"""Build small traces by hand (times in ms) for analyzer tests with known answers."""

from __future__ import annotations

import json

from gputrace.trace import write_trace

MS = 1_000_000


class Builder:
    def __init__(self, host: str = "h", clock_ms: float = 0.0) -> None:
        """`clock_ms`: how far this host's clock is ahead (every time written is shifted)."""
        self.rows: list[tuple] = []
        self.host = host
        self.clock_ms = clock_ms

    def span(self, cat, start_ms, end_ms, *, name=None, rank=0, pid=1, tid=1, step=-1,
             layer=-1, nbytes=None, layers=None, src_kind=None, device=-1, stream=-1,
             args=None):
        """`args`: a dict written as the row's args (beside `layers`)."""
        a = dict(args or {})
        if layers is not None:
            a["layers"] = layers
        args = json.dumps(a) if a else None
        start_ms, end_ms = start_ms + self.clock_ms, end_ms + self.clock_ms
        self.rows.append(("span", cat, name or cat, int(start_ms * MS), int(end_ms * MS), None,
                          None, self.host, rank, pid, tid, device, stream, step, layer, nbytes,
                          src_kind, None, None, args))
        return self

    def sample(self, name, t_ms, value, unit="bytes", cat="host"):
        t_ms += self.clock_ms
        self.rows.append(("sample", cat, name, int(t_ms * MS), None, float(value), unit,
                          self.host,
                          -1, 1, -1, -1, -1, -1, -1, None, None, None, None, None))
        return self

    def write(self, path, **md):
        write_trace(path, dict({"host": self.host}, **md),
                    rows=sorted(self.rows, key=lambda r: r[3]))
        return path

    def write_by_rank(self, path, **md):
        """As `record` writes a node's trace: sorted by rank, one rank per record batch."""
        import pyarrow as pa

        from gputrace.trace.schema import COLUMN_NAMES, conform
        from gputrace.trace.writer import write_by_rank

        cols = list(zip(*self.rows, strict=True))
        table = pa.table({n: list(c) for n, c in zip(COLUMN_NAMES, cols, strict=False)})
        write_by_rank(path, dict({"host": self.host}, **md), conform(table))
        return path


def ddp_iterations(b: Builder, units, *, n=6, rank=0, shift=0.0, update=(90, 98),
                   per_layer_bwd=((4, 30, 40), (3, 40, 55), (2, 55, 70), (1, 70, 85)),
                   wait=0.0):
    """n iterations of 100 ms: io wait 0-5, forward 5-30, backward per layer, the given comm
    units [(layers, start, end)], update. `wait`: ms more waiting for data, which makes
    each iteration that much longer."""
    for k in range(n):
        it = k * (100 + wait) + shift
        base = it + wait
        b.span("iteration", it, base + 100, step=k, rank=rank)
        b.span("io", it, base + 5, step=k, rank=rank)
        b.span("forward", base + 5, base + 30, step=k, rank=rank)
        for layer, s, e in per_layer_bwd:
            b.span("backward", base + s, base + e, layer=layer, step=k, rank=rank)
        for idx, (layers, s, e) in enumerate(units):
            b.span("comm", base + s, base + e, name="allreduce", layer=idx, step=k, rank=rank,
                   tid=9, nbytes=1_000_000 * len(layers), layers=layers)
        b.span("update", base + update[0], base + update[1], step=k, rank=rank)
    return b


def two_ranks(path, colls, n=8, world=2):
    """2 ranks (or `world`) of n 50 ms iterations (forward 1-15, backward 15-40, update
    40-48 ms), each with the collectives given: (kind, phase, start ms, end ms, bytes, args
    beside kind, phase and a synchronous call)."""
    b = Builder()
    for rank in range(world):
        for k in range(n):
            t = k * 50.0
            b.span("iteration", t, t + 50, step=k, rank=rank)
            b.span("forward", t + 1, t + 15, step=k, rank=rank)
            b.span("backward", t + 15, t + 40, step=k, rank=rank)
            b.span("update", t + 40, t + 48, step=k, rank=rank)
            for kind, phase, s, e, nb, args in colls:
                b.span("comm", t + s, t + e, name=kind, step=k, rank=rank, nbytes=nb,
                       args={"kind": kind, "phase": phase, "async": False, "bytes_out": nb,
                             **args})
    return b.write(str(path), world_size=world)
