"""The columns analyzers need, as numpy arrays, grouped by rank. No I/O."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from gputrace.trace.ranked import RankColumns


# the trace columns a frame is built from, in the order `build` converts them
COLUMNS = ("kind", "rank", "cat", "name", "start_ns", "end_ns", "pid", "tid", "device", "step",
           "layer", "bytes", "args", "src_kind", "dst_kind", "phase", "launch_ns", "value",
           "unit", "stream", "host")
_SAMPLE_COLUMNS = ("name", "device", "start_ns", "value", "unit", "host")
# the columns of the samples and instants a frame's `others` (build's) is handed, beside
# `kind`: what the sections beside the analysis read of them (analyzers.extras.held)
OTHER_COLUMNS = ("cat", "name", "host", "rank", "pid", "device", "value", "unit", "start_ns",
                 "step", "args")


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[str]]:
    """Dictionary codes (-1 for null) and values of a string column.

    A trace file's batches share one dictionary that only grows (deltas), so every chunk's
    dictionary is a prefix of the longest: the indices are used as they are. Other inputs
    (merged shards, imports) get their dictionaries unified first."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if not chunks:
        return np.zeros(0, np.int32), []
    if not pa.types.is_dictionary(chunks[0].type):
        arr = pc.dictionary_encode(pa.chunked_array(chunks).combine_chunks())
        chunks = [arr]
    longest = max(chunks, key=lambda c: len(c.dictionary)).dictionary
    if not all(c.dictionary.equals(longest.slice(0, len(c.dictionary))) for c in chunks):
        unified = pa.table({"c": pa.chunked_array(chunks)}).unify_dictionaries().column("c")
        chunks = unified.chunks
        longest = chunks[0].dictionary
    idx = np.concatenate([c.indices.fill_null(-1).to_numpy(zero_copy_only=False)
                          for c in chunks]).astype(np.int32, copy=False)
    return idx, [str(v) for v in longest.to_pylist()]


def _np(col: pa.ChunkedArray, fill: int | float = -1, dtype: type = np.int64) -> np.ndarray:
    if col.null_count:
        col = col.fill_null(fill)
    return col.to_numpy().astype(dtype, copy=False)


@dataclass
class Spans:
    """All spans of one rank."""

    rank: int
    cat: np.ndarray          # category code
    cats: list[str]          # code -> category
    name: np.ndarray
    names: list[str]
    start: np.ndarray
    end: np.ndarray
    pid: np.ndarray
    tid: np.ndarray
    device: np.ndarray
    step: np.ndarray
    layer: np.ndarray
    nbytes: np.ndarray       # float, nan when unknown
    args: pa.Array                  # string, read lazily (only comm units need it)
    src_kind: np.ndarray            # memory-kind codes (-1 null) into `mem_kinds`
    dst_kind: np.ndarray
    mem_kinds: list[str]
    phase: np.ndarray               # attributed-phase codes (-1 null) into `phases`
    phases: list[str]
    launch: np.ndarray              # GPU records: host time of their launch (-1 unknown)
    _mask_cache: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    stream: np.ndarray | None = None   # CUDA stream (-1 none); None when not read
    host: str = ""                     # the host most of its rows were recorded on

    def of(self, cat: str) -> np.ndarray:
        """Boolean mask of the spans in a category."""
        m = self._mask_cache.get(cat)
        if m is None:
            code = self.cats.index(cat) if cat in self.cats else -2
            m = self._mask_cache[cat] = self.cat == code
        return m

    def lasting(self) -> np.ndarray:
        """Mask of the spans that end after they start."""
        m = self._mask_cache.get("\0lasting")
        if m is None:
            m = self._mask_cache["\0lasting"] = self.end > self.start
        return m

    def kind_is(self, which: str, kind: str) -> np.ndarray:
        """Mask of spans whose src_kind/dst_kind ('src'/'dst') is the given memory kind."""
        code = self.mem_kinds.index(kind) if kind in self.mem_kinds else -2
        return (self.src_kind if which == "src" else self.dst_kind) == code

    def in_phase(self, phase: str) -> np.ndarray:
        """Mask of GPU spans attributed to a phase (their launch's enclosing range)."""
        code = self.phases.index(phase) if phase in self.phases else -2
        return self.phase == code

    def on_gpu(self) -> np.ndarray:
        """Mask of GPU activity: kernels, copies, sets and NCCL comm recorded on a device."""
        return (self.device >= 0) & (self.of("kernel") | self.of("memcpy") | self.of("memset")
                                     | self.of("comm"))

    def layer_sets(self, idx: np.ndarray) -> tuple[np.ndarray, list[tuple[int, ...] | None]]:
        """For the spans `idx`: a code per span into a list of distinct `args.layers`
        (None where absent); each distinct args string is parsed once."""
        if idx.size == 0:
            return np.zeros(0, dtype=np.int64), [None]
        taken = self.args.take(pa.array(idx))
        if isinstance(taken, pa.ChunkedArray):
            taken = taken.combine_chunks()
        enc = taken.dictionary_encode()
        sets = [tuple(v) if v else None for v in map(_layers, enc.dictionary.to_pylist())]
        codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        sets.append(None)   # code -1 (no args) -> the last entry
        return codes, sets


def _layers(a: str | None) -> list[int] | None:
    if not a:
        return None
    try:
        v = json.loads(a).get("layers")
    except (ValueError, AttributeError):
        return None
    if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
        return v
    return None


@dataclass
class Samples:
    """Samples of one name (cumulative counters or rates), all sources, sorted by time."""

    t: np.ndarray
    value: np.ndarray
    unit: str


@dataclass
class Frame:
    ranks: dict[int, Spans]
    hosts: dict[str, dict[str, Samples]]    # host -> its samples by name
    metadata: dict[str, object]
    # what build's `others` kept of the frame's samples and instants (None: nothing)
    others: pa.Table | None = None
    present: tuple[int, ...] = ()           # the ranks its rows carry, as stored (-1 too)

    @property
    def samples(self) -> dict[str, Samples]:
        """The samples by name, of every host (a trace of one host: its own)."""
        if len(self.hosts) == 1:
            return next(iter(self.hosts.values()))
        return merge_samples(list(self.hosts.values()))


def build(table: pa.Table | dict[str, pa.ChunkedArray] | RankColumns,
          metadata: dict[str, object] | None = None, drop_unranked: bool = False,
          others: Callable[[pa.Table], pa.Table | None] | None = None) -> Frame:
    """The frame of a table, or of a dict of its columns, or of a RankColumns that reads
    each column as it is asked for: a dict is emptied as the columns are converted, so the
    caller that hands over its only reference to them never holds the table and its numpy
    copy at once. Spans without a rank are dropped when they stand beside ranked ones
    (launchers such as torchrun), here or, with `drop_unranked`, in another part of the
    same trace. `others`: given the frame's samples and instants (`kind` and
    OTHER_COLUMNS, put aside as each column is converted, as the samples are), what of them
    the frame keeps (Frame.others), with the ranks its rows carry (Frame.present)."""
    cols = table if not isinstance(table, pa.Table) else \
        {c: table.column(c) for c in table.column_names}
    del table
    kind_col = cols.pop("kind")
    n_all = len(kind_col)
    kind_codes, kinds = _codes(kind_col)
    del kind_col
    span_code = kinds.index("span") if "span" in kinds else -2
    sample_code = kinds.index("sample") if "sample" in kinds else -2
    is_sample = kind_codes == sample_code
    aside_mask = is_sample if others is None else \
        is_sample | (kind_codes == (kinds.index("instant") if "instant" in kinds else -2))
    aside = np.flatnonzero(aside_mask)
    keep = pa.array(aside_mask) if aside.size else None
    aside_sample = is_sample[aside]         # which of the rows put aside are samples
    del aside_mask, is_sample
    stash = _SAMPLE_COLUMNS if others is None else OTHER_COLUMNS
    smp: dict[str, pa.ChunkedArray] = {}
    present: set[int] = set()

    def pop(name: str) -> pa.ChunkedArray:
        """A column, handed over; its sample rows (few), and where `others` is given its
        instants (fewer), are put aside first."""
        c = cols.pop(name)
        if keep is not None and name in stash:
            smp[name] = c.filter(keep)
        if name == "rank" and others is not None:
            present.update(int(r) for r in pc.unique(c).to_pylist() if r is not None)
        return c

    ranks: dict[int, Spans] = {}
    is_span = kind_codes == span_code
    rank_all = _np(pop("rank"), -1, np.int32) if is_span.any() else None
    if rank_all is not None:
        unranked = (rank_all == -1) & is_span
        # spans without a rank beside ranked ones: dropped
        if drop_unranked or (unranked.any() and (is_span & ~unranked).any()):
            is_span &= rank_all >= 0
        del unranked
    if rank_all is not None and is_span.any():
        sel = np.flatnonzero(is_span)
        # one permutation puts each rank's spans together: per-rank arrays are views
        rs = rank_all[sel]
        order = sel if (rs[1:] >= rs[:-1]).all() else sel[np.argsort(rs, kind="stable")]
        del rs
        # the spans in rank order already (a rank read alone): no permutation, at most a
        # mask (a boolean one selects faster than indices), none when every row is a span
        in_order = order is sel
        same = in_order and sel.size == n_all
        pick = is_span if in_order else order
        rank = rank_all if same else rank_all[pick]
        del rank_all, sel

        def put(a: np.ndarray) -> np.ndarray:
            """A column in the frame's order, the frame's own (writable) array."""
            if not same:
                return a[pick]
            return a if a.flags.writeable else a.copy()

        def col(name: str, fill: int, dtype: type) -> np.ndarray:
            return put(_np(pop(name), fill, dtype))

        def codes(name: str) -> tuple[np.ndarray, list[str]]:
            c, values = _codes(pop(name))
            return put(c), values

        cat, cats = codes("cat")
        name, names = codes("name")
        start = col("start_ns", 0, np.int64)
        end = col("end_ns", -1, np.int64)
        np.copyto(end, start, where=end < 0)
        pid = col("pid", -1, np.int64)
        tid = col("tid", -1, np.int64)
        device = col("device", -1, np.int16)
        step = col("step", -1, np.int32)
        layer = col("layer", -1, np.int32)
        nbytes = put(pop("bytes").cast(pa.float64()).fill_null(np.nan).to_numpy())
        args = pop("args")
        if not same:
            args = args.take(pa.array(order))
        mem = pa.chunked_array(pop("src_kind").chunks + pop("dst_kind").chunks)
        mem_codes, mem_kinds = _codes(mem)
        del mem
        srck, dstk = put(mem_codes[:n_all]), put(mem_codes[n_all:])
        del mem_codes
        stream = col("stream", -1, np.int32) if "stream" in cols else None
        if "phase" in cols:
            phase, phases = codes("phase")
        else:
            phase, phases = np.full(order.size, -1, np.int32), []
        launch = col("launch_ns", -1, np.int64) if "launch_ns" in cols else \
            np.full(order.size, -1, np.int64)
        host, hosts = codes("host") if "host" in cols else (np.full(order.size, -1), [])
        cuts = np.flatnonzero(np.diff(rank)) + 1
        bounds = np.concatenate(([0], cuts, [rank.size]))
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            # spans of processes without a rank (a single-process job) count as rank 0
            r = max(int(rank[lo]), 0)
            sl = slice(int(lo), int(hi))
            ranks[r] = Spans(
                rank=r, cat=cat[sl], cats=cats, name=name[sl], names=names,
                start=start[sl], end=end[sl], pid=pid[sl], tid=tid[sl],
                device=device[sl], step=step[sl], layer=layer[sl], nbytes=nbytes[sl],
                args=args.slice(int(lo), int(hi) - int(lo)), src_kind=srck[sl],
                dst_kind=dstk[sl], mem_kinds=mem_kinds, phase=phase[sl], phases=phases,
                launch=launch[sl], stream=None if stream is None else stream[sl],
                host=_most(host[sl], hosts))
    samples: dict[str, dict[str, Samples]] = {}
    if keep is not None or others is not None:
        for c in stash if keep is not None else ("rank",):
            if c not in smp and c in cols:
                pop(c)
    cols.clear()
    kept = None
    if others is not None and keep is not None:
        kept = others(pa.table({"kind": pa.DictionaryArray.from_arrays(
            kind_codes[aside], pa.array(kinds, pa.string())), **smp}))
    if not aside_sample.all():     # instants among the rows put aside
        smp = {c: smp[c].filter(pa.array(aside_sample)) for c in _SAMPLE_COLUMNS
               if c in smp} if aside_sample.any() else {}
    if smp:
        name, names = _codes(smp["name"])
        dev = _np(smp["device"], -1, np.int32)
        t = _np(smp["start_ns"], 0)
        v = smp["value"].fill_null(np.nan).to_numpy()
        units = smp["unit"].cast(pa.string()).to_pylist()
        if "host" in smp:
            host, hosts = _codes(smp["host"])
        else:
            host, hosts = np.zeros(t.size, np.int32), [""]
        order = np.argsort(t, kind="stable")
        for hc in np.unique(host):
            mine = order[host[order] == hc]
            # each host's counters stay apart: a node's cumulative bytes are its own
            out = samples.setdefault(hosts[hc] if hc >= 0 else "", {})
            for code, nm in enumerate(names):
                sel = mine[name[mine] == code]
                for d in np.unique(dev[sel]):
                    idx = sel[dev[sel] == d]
                    key = nm if d < 0 else f"{nm}@{d}"  # per-GPU counters stay apart
                    out[key] = Samples(t[idx], v[idx], units[idx[0]] or "")
    return Frame(ranks, samples, dict(metadata or {}), kept, tuple(sorted(present)))


def _most(codes: np.ndarray, values: list[str]) -> str:
    """The most frequent value of some dictionary codes ('' when none is known)."""
    codes = codes[codes >= 0]
    if not codes.size:
        return ""
    return values[int(np.argmax(np.bincount(codes)))]


def merge_hosts(parts: list[dict[str, dict[str, Samples]]]) -> dict[str, dict[str, Samples]]:
    """The samples of several frames of one trace, by host, as one frame of the whole would
    hold them."""
    out: dict[str, list[dict[str, Samples]]] = {}
    for part in parts:
        for host, smp in part.items():
            out.setdefault(host, []).append(smp)
    return {h: merge_samples(v) for h, v in out.items()}


def merge_samples(parts: list[dict[str, Samples]]) -> dict[str, Samples]:
    """Samples of one name from several parts, merged in time."""
    out: dict[str, Samples] = {}
    for part in parts:
        for key, s in part.items():
            have = out.get(key)
            if have is None:
                out[key] = s
                continue
            t = np.concatenate([have.t, s.t])
            order = np.argsort(t, kind="stable")
            out[key] = Samples(t[order], np.concatenate([have.value, s.value])[order], have.unit)
    return out
