"""What the importers share: the row builder, phase names, and kernel → phase attribution."""

from __future__ import annotations

import re
from array import array
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace.trace.schema import COLUMN_NAMES, COLUMNS, DEFAULTS

PHASES = ("io", "h2d", "forward", "backward", "update", "comm")

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_GLOO = ("gloo:all_reduce", "gloo:allreduce")
_BACKWARD_OP = re.compile(r"^[A-Za-z0-9_]+Backward\d*\b")
_DECORATED = re.compile(r"^[#\s]*([A-Za-z_ ]+?)[#\s]*$")
_ALIASES = {"optimizer": "update", "optimizer_step": "update", "optimizer step": "update",
            "data_load": "io", "load_batch": "io", "wait_for_batch": "io"}


class ImportFailed(ValueError):
    """The input cannot be imported; the message is one line for the user."""


def phase_of(name: str) -> tuple[str | None, int]:
    """Which gputrace phase a range of another tool stands for: (cat or None, step or -1).

    `ProfilerStep#N` is iteration N; the DataLoader's `__next__` is the loop waiting for data;
    optimizer steps are update; autograd's backward functions are backward; DDP's and
    nn.Module forwards are forward; gputrace's own phase names and decorated names like
    `## forward ##` are taken as they say.
    """
    m = _STEP.match(name)
    if m:
        return "iteration", int(m.group(1))
    if name in PHASES or name == "iteration":
        return name, -1
    if name.startswith("enumerate(DataLoader)"):
        return "io", -1
    if name.startswith("Optimizer.step#"):
        return "update", -1
    if name.startswith("autograd::engine::evaluate_function:") or _BACKWARD_OP.match(name):
        return "backward", -1
    if name.startswith(("DistributedDataParallel.forward", "nn.Module:")):
        return "forward", -1
    if name.startswith(_GLOO):   # gloo's own range around each collective, on its thread
        return "comm", -1
    m = _DECORATED.match(name)
    if m and name != m.group(1):
        word = m.group(1).strip().lower()
        word = _ALIASES.get(word, word)
        if word in PHASES:
            return word, -1
    return None, -1


_MEM = {"pageable": "pageable", "pinned": "pinned", "device": "device", "managed": "managed"}
_MEMCPY_NAME = re.compile(r"\((\w+)\s*->\s*(\w+)\)")


def memcpy_kinds(name: str) -> tuple[str | None, str | None]:
    """'Memcpy HtoD (Pageable -> Device)' -> ('pageable', 'device')."""
    m = _MEMCPY_NAME.search(name)
    if not m:
        return None, None
    return _MEM.get(m.group(1).lower()), _MEM.get(m.group(2).lower())


def is_nccl(name: str) -> bool:
    return name.lower().startswith("nccl")


def _later_stands(keys: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each key, in key order (of two entries with one
    key, the later stands)."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    return order[np.append(k[1:] != k[:-1], True)]


class Rows:
    """Column lists that become Arrow batches every `chunk` rows (memory ~ the output)."""

    _INDEX = {n: i for i, n in enumerate(COLUMN_NAMES)}

    def __init__(self, chunk: int = 1 << 16) -> None:
        self.chunk = chunk
        self.batches: list[pa.RecordBatch] = []
        self._cols: list[list[Any]] = [[] for _ in COLUMN_NAMES]
        self.count = 0
        self._patches: dict[str, list[tuple[np.ndarray, Any]]] = {}
        self._base = tuple(DEFAULTS[n] for n in COLUMN_NAMES)
        self._schema = pa.schema([pa.field(n, t, nullable=True) for n, t, _, _ in COLUMNS])

    def add(self, kind: str, cat: str, name: str, start: int, end: int | None = None,
            **cols: Any) -> int:
        """Append one row; `cols` by column name (`bytes`, `rank`, ...). Returns its index."""
        row = list(self._base)
        row[0], row[1], row[2], row[3], row[4] = kind, cat, name, start, end
        for k, v in cols.items():
            row[self._INDEX[k]] = v
        for col, v in zip(self._cols, row, strict=True):
            col.append(v)
        self.count += 1
        if len(self._cols[0]) >= self.chunk:
            self._seal()
        return self.count - 1

    def add_columns(self, n: int, **cols: Any) -> int:
        """Append n rows given as columns by name (a sequence or Arrow array each, or one
        value for all); the other columns take their defaults. Returns the index of the
        first."""
        first = self.count
        if not n:
            return first
        self._seal()
        try:
            arrays = []
            for name, f in zip(COLUMN_NAMES, self._schema, strict=True):
                v = cols.get(name, DEFAULTS[name])
                if isinstance(v, pa.Array):
                    arrays.append(v.cast(f.type))
                elif isinstance(v, list | tuple | np.ndarray):
                    arrays.append(self._array(v, f.type))
                elif v is None:
                    arrays.append(pa.nulls(n, f.type))
                else:
                    base = f.type.value_type if pa.types.is_dictionary(f.type) else f.type
                    arrays.append(pa.repeat(pa.scalar(v, base), n).cast(f.type))
        except (pa.ArrowInvalid, OverflowError, TypeError) as e:
            raise ImportFailed(f"a value does not fit the trace format: {e}") from None
        self.batches.append(pa.RecordBatch.from_arrays(arrays, schema=self._schema))
        self.count += n
        return first

    def since(self, first: int, columns: list[str]) -> pa.Table:
        """`columns` of the rows added from index `first` on, as added (before set_many)."""
        self._seal()
        out, at = [], 0
        for b in self.batches:
            if at + b.num_rows > first:
                out.append(b.slice(max(first - at, 0)).select(columns))
            at += b.num_rows
        return pa.Table.from_batches(out, pa.schema([self._schema.field(c) for c in columns]))

    def set_many(self, column: str, rows: np.ndarray, values: Sequence[Any]) -> None:
        """Change `column` of rows already added (applied when the table is built; where a row
        is set twice, the later value stands)."""
        if len(rows):
            self._patches.setdefault(column, []).append((np.asarray(rows, np.int64), values))

    @staticmethod
    def _array(values: list[Any], typ: pa.DataType) -> pa.Array:
        if pa.types.is_dictionary(typ):   # names repeat: held dictionary-encoded
            return pa.array(values, pa.string()).cast(typ)
        return pa.array(values, typ)

    def _seal(self) -> None:
        if not self._cols[0]:
            return
        try:
            arrays = [self._array(c, f.type) for c, f in zip(self._cols, self._schema,
                                                              strict=True)]
        except (pa.ArrowInvalid, OverflowError, TypeError) as e:
            raise ImportFailed(f"a value does not fit the trace format: {e}") from None
        self.batches.append(pa.RecordBatch.from_arrays(arrays, schema=self._schema))
        self._cols = [[] for _ in COLUMN_NAMES]

    def table(self) -> pa.Table:
        self._seal()
        t = pa.Table.from_batches(self.batches, schema=self._schema)
        for column, parts in self._patches.items():
            idx = np.concatenate([p[0] for p in parts])
            vals = np.concatenate([np.asarray(p[1], dtype=object) for p in parts])
            pick = _later_stands(idx)
            idx, vals = idx[pick], vals[pick]
            i = t.schema.get_field_index(column)
            field = t.schema.field(i)
            col = t.column(i).combine_chunks()
            if pa.types.is_dictionary(field.type):
                col = col.cast(field.type.value_type)
            mask = np.zeros(len(col), dtype=bool)
            mask[idx] = True
            col = pc.replace_with_mask(col, pa.array(mask), self._array(list(vals), col.type))
            t = t.set_column(i, field, col.cast(field.type))
        return t

    def tuples(self, **fixed: Any) -> list[tuple[Any, ...]]:
        """The rows as a recorder's tuples (COLUMN_NAMES' order), with the columns `fixed`
        names (e.g. the recording process's `host`) set in every row."""
        table = self.table()
        cols = [table.column(c).to_pylist() for c in COLUMN_NAMES]
        for name, value in fixed.items():
            cols[self._INDEX[name]] = [value] * table.num_rows
        return list(zip(*cols, strict=True))


def attribute(phase_key: Sequence[Any], phase_start: np.ndarray, phase_end: np.ndarray,
              launch_key: Sequence[Any], launch_t: np.ndarray,
              fallback: dict[Any, Any] | None = None) -> np.ndarray:
    """For each launch, the index of the innermost phase range open on the same thread at the
    launch time (the range that started last among those enclosing it), or -1.

    Keys name threads (e.g. (pid, tid)). Ranges on one thread nest, as NVTX push/pop and
    PyTorch's record_function do. `fallback` maps a thread to the one it works for: a launch
    in no range of its own thread takes the range open on that one at the time (autograd's
    device threads launch the backward while the loop's thread waits in it).
    """
    by_key: dict[Any, list[int]] = defaultdict(list)
    for i, k in enumerate(phase_key):
        by_key[k].append(i)
    out = _attribute(by_key, phase_start, phase_end, launch_key, launch_t)
    if fallback:
        miss = [i for i in np.flatnonzero(out < 0).tolist()
                if fallback.get(launch_key[i], launch_key[i]) != launch_key[i]]
        if miss:
            again = _attribute(by_key, phase_start, phase_end,
                               [fallback[launch_key[i]] for i in miss], launch_t[miss])
            out[miss] = again
    return out


def _attribute(by_key: dict[Any, list[int]], phase_start: np.ndarray, phase_end: np.ndarray,
               launch_key: Sequence[Any], launch_t: np.ndarray) -> np.ndarray:
    out = np.full(len(launch_t), -1, dtype=np.int64)
    launches: dict[Any, list[int]] = defaultdict(list)
    for i, k in enumerate(launch_key):
        if k in by_key:
            launches[k].append(i)
    found: list[int] = []
    at: list[int] = []
    for k, li in launches.items():
        pi = np.array(by_key[k])
        pi = pi[np.lexsort((-phase_end[pi], phase_start[pi]))]  # outer first on ties
        la = np.array(li)
        la = la[np.argsort(launch_t[la], kind="stable")]
        # plain lists: the loop below runs once per launch
        pis, starts = pi.tolist(), phase_start[pi].tolist()
        ends = dict(zip(pis, phase_end[pi].tolist(), strict=True))
        stack: list[int] = []
        j, n = 0, len(pis)
        for i, t in zip(la.tolist(), launch_t[la].tolist(), strict=True):
            while j < n and starts[j] <= t:
                stack.append(pis[j])
                j += 1
                # drop ranges that ended before the newly opened one (already closed)
            while stack and ends[stack[-1]] < t:
                stack.pop()
            # an inner range that closed may hide an outer one still open: look down
            for p in reversed(stack):
                if ends[p] >= t:
                    at.append(i)
                    found.append(p)
                    break
    if at:
        out[np.array(at, np.int64)] = found
    return out


def iteration_of(iter_start: np.ndarray, iter_end: np.ndarray, iter_step: np.ndarray,
                 t: np.ndarray) -> np.ndarray:
    """The step of the iteration window holding each time, -1 outside all of them."""
    if iter_start.size == 0:
        return np.full(t.size, -1, dtype=np.int64)
    order = np.argsort(iter_start, kind="stable")
    s, e, st = iter_start[order], iter_end[order], iter_step[order]
    k = np.searchsorted(s, t, side="right") - 1
    ok = (k >= 0) & (t <= e[np.clip(k, 0, None)])
    return np.where(ok, st[np.clip(k, 0, None)], -1)


def launch_context(phases: list[tuple[Any, int, int, str]], iters: list[tuple[int, int, int]],
                   keys: Sequence[Any], times: Sequence[int],
                   fallback: dict[Any, Any] | None = None
                   ) -> tuple[list[str | None], np.ndarray]:
    """Phase and step each launch (thread key, time) was made in.

    phases: (thread key, start, end, cat) of phase ranges; iters: (start, end, step);
    fallback: as `attribute`. Returns the innermost phase open on the launching thread (or
    on the thread it works for) or None, and the step of the iteration window holding the
    launch (or -1)."""
    t = np.asarray(times, dtype=np.int64)
    which = attribute([p[0] for p in phases], np.array([p[1] for p in phases], np.int64),
                      np.array([p[2] for p in phases], np.int64), keys, t, fallback)
    if iters:
        it = np.array(iters, dtype=np.int64)
        steps = iteration_of(it[:, 0], it[:, 1], it[:, 2], t)
    else:
        steps = np.full(t.size, -1, dtype=np.int64)
    return [phases[w][3] if w >= 0 else None for w in which], steps


class Launches:
    """Where imported GPU work was launched from, kept in flat int64 arrays rather than
    dicts of tuples (a few hundred bytes less per event while a file is parsed).

    `call(scope, corr, pid, tid, t)`: a launching API call; `gpu(row, scope, corr)`: a GPU row
    made by the call with that correlation id. `scope` tells apart processes whose ids may
    clash (nsys: the pid; one Kineto file: 0). Where one id is called twice, the later stands.
    """

    def __init__(self) -> None:
        self.calls = array("q")
        self.work = array("q")

    @staticmethod
    def _known(corr: Any) -> bool:
        return isinstance(corr, int) and 0 <= corr < 2**63      # else: no correlation

    def call(self, scope: int, corr: Any, pid: int, tid: int, t: int) -> None:
        if self._known(corr):
            self.calls.extend((scope, corr, pid, tid, t))

    def gpu(self, row: int, scope: int, corr: Any) -> None:
        if self._known(corr):
            self.work.extend((row, scope, corr))

    def matched(self) -> tuple[np.ndarray, np.ndarray]:
        """(GPU row indices, their calls as rows of (scope, corr, pid, tid, t))."""
        calls = np.frombuffer(self.calls, np.int64).reshape(-1, 5) if self.calls else \
            np.empty((0, 5), np.int64)
        work = np.frombuffer(self.work, np.int64).reshape(-1, 3) if self.work else \
            np.empty((0, 3), np.int64)
        at, found = [], []
        for scope in np.unique(work[:, 1]):
            c = calls[calls[:, 0] == scope]
            if not len(c):
                continue
            c = c[_later_stands(c[:, 1])]
            w = work[work[:, 1] == scope]
            k = np.clip(np.searchsorted(c[:, 1], w[:, 2]), 0, len(c) - 1)
            hit = c[k, 1] == w[:, 2]
            at.append(w[hit, 0])
            found.append(c[k[hit]])
        if not at:
            return np.empty(0, np.int64), np.empty((0, 5), np.int64)
        return np.concatenate(at), np.concatenate(found)


def loop_threads(phases: list[tuple[Any, int, int, str]], iters_by_thread: dict[Any, int]
                 ) -> dict[int, Any]:
    """pid -> the (pid, tid) of its training loop: the thread that holds the iterations,
    else the one with the most phase ranges."""
    counts: dict[Any, int] = defaultdict(int)
    for key, _, _, _ in phases:
        counts[key] += 1
    loops: dict[int, Any] = {}
    for table in (counts, iters_by_thread):   # iterations win over phase counts
        for key, _n in sorted(table.items(), key=lambda kv: kv[1]):
            loops[key[0]] = key
    return loops


def attribute_launches(rows: Rows, phases: list[tuple[Any, int, int, str]],
                       iters: list[tuple[int, int, int]], launches: Launches,
                       fixed: set[int] = frozenset(), loops: dict[int, Any] | None = None,
                       h2d_rows: set[int] = frozenset()) -> None:
    """Give every imported GPU row the phase and step its launch was made in, and the launch
    time (`launch_ns`).

    phases key threads by (pid, tid); fixed: rows whose phase is already known (NCCL kernels
    are comm wherever launched); loops: pid -> (pid, tid) of its loop thread, whose open
    range a launch on another thread with none of its own takes; h2d_rows: host-to-device
    copies, `h2d` when launched in no phase.
    """
    at, calls = launches.matched()
    if not len(at):
        return
    threads = list(zip(calls[:, 2].tolist(), calls[:, 3].tolist(), strict=True))
    fallback = None
    if loops:
        fallback = {k: loops[k[0]] for k in set(threads) if k[0] in loops}
    phase, steps = launch_context(phases, iters, threads, calls[:, 4], fallback)
    ph = np.array(phase, dtype=object)
    if h2d_rows:
        copy = np.isin(at, np.fromiter(h2d_rows, np.int64, len(h2d_rows)))
        ph[copy & (ph == None)] = "h2d"  # noqa: E711
    keep = (ph != None) & ~np.isin(at, np.fromiter(fixed, np.int64, len(fixed)))  # noqa: E711
    rows.set_many("phase", at[keep], ph[keep])
    rows.set_many("step", at[steps >= 0], steps[steps >= 0])
    rows.set_many("launch_ns", at, calls[:, 4])
