"""The columns analyzers need, as numpy arrays, grouped by rank. No I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def _codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Dictionary codes and values of a string column (dictionary-encoded or not)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not pa.types.is_dictionary(arr.type):
        arr = pc.dictionary_encode(arr)
    elif isinstance(col, pa.ChunkedArray) and col.num_chunks > 1:
        arr = pc.dictionary_encode(arr.cast(pa.string()))
    idx = arr.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int32)
    return idx, [str(v) for v in arr.dictionary.to_pylist()]


def _np(col: pa.ChunkedArray, fill: int | float = -1, dtype: type = np.int64) -> np.ndarray:
    return col.fill_null(fill).to_numpy().astype(dtype, copy=False)


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
    args: list[str | None]
    src_kind: list[str | None]
    phase: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # attributed phase
    phases: list[str] = field(default_factory=list)
    dst_kind: list[str | None] = field(default_factory=list)
    _mask_cache: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def of(self, cat: str) -> np.ndarray:
        """Boolean mask of the spans in a category."""
        m = self._mask_cache.get(cat)
        if m is None:
            code = self.cats.index(cat) if cat in self.cats else -2
            m = self._mask_cache[cat] = self.cat == code
        return m

    def in_phase(self, phase: str) -> np.ndarray:
        """Mask of GPU spans attributed to a phase (their launch's enclosing range)."""
        code = self.phases.index(phase) if phase in self.phases else -2
        return self.phase == code

    def on_gpu(self) -> np.ndarray:
        """Mask of GPU activity: kernels, copies, sets and NCCL comm recorded on a device."""
        return (self.device >= 0) & (self.of("kernel") | self.of("memcpy") | self.of("memset")
                                     | self.of("comm"))

    def layers_of(self, i: int) -> list[int] | None:
        a = self.args[i]
        if not a:
            return None
        try:
            v = json.loads(a).get("layers")
        except (ValueError, AttributeError):
            return None
        if isinstance(v, list) and all(isinstance(x, int) for x in v):
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
    samples: dict[str, Samples]
    metadata: dict[str, object]


def build(table: pa.Table, metadata: dict[str, object] | None = None) -> Frame:
    kind_codes, kinds = _codes(table.column("kind"))
    span_code = kinds.index("span") if "span" in kinds else -2
    sample_code = kinds.index("sample") if "sample" in kinds else -2
    spans = table.filter(pa.array(kind_codes == span_code))
    ranks: dict[int, Spans] = {}
    if spans.num_rows:
        rank = _np(spans.column("rank"), -1, np.int32)
        cat, cats = _codes(spans.column("cat"))
        name, names = _codes(spans.column("name"))
        start = _np(spans.column("start_ns"), 0)
        end_raw = spans.column("end_ns")
        end = np.where(_np(end_raw, -1) < 0, start, _np(end_raw, -1))
        pid = _np(spans.column("pid"), -1, np.int64)
        tid = _np(spans.column("tid"), -1, np.int64)
        device = _np(spans.column("device"), -1, np.int32)
        step = _np(spans.column("step"), -1, np.int32)
        layer = _np(spans.column("layer"), -1, np.int32)
        nbytes = spans.column("bytes").cast(pa.float64()).fill_null(np.nan).to_numpy()
        args = spans.column("args").to_pylist()
        srck = spans.column("src_kind").cast(pa.string()).to_pylist()
        dstk = spans.column("dst_kind").cast(pa.string()).to_pylist()
        if "phase" in spans.column_names:
            phase, phases = _codes(spans.column("phase"))
        else:
            phase, phases = np.full(spans.num_rows, -1, np.int32), []
        # spans of processes without a rank (a single-process job) count as rank 0
        present = np.unique(rank)
        if present.size > 1 and -1 in present:
            # unranked spans beside ranked ones belong to launchers (torchrun): drop them
            keep_rank = rank >= 0
        else:
            keep_rank = np.ones(rank.size, dtype=bool)
        for r in np.unique(rank[keep_rank]):
            m = (rank == r) & keep_rank
            idx = np.flatnonzero(m)
            ranks[max(int(r), 0)] = Spans(
                rank=max(int(r), 0), cat=cat[idx], cats=cats, name=name[idx], names=names,
                start=start[idx], end=end[idx], pid=pid[idx], tid=tid[idx],
                device=device[idx], step=step[idx], layer=layer[idx], nbytes=nbytes[idx],
                args=[args[i] for i in idx], src_kind=[srck[i] for i in idx],
                phase=phase[idx], phases=phases, dst_kind=[dstk[i] for i in idx])
    samples: dict[str, Samples] = {}
    smp = table.filter(pa.array(kind_codes == sample_code))
    if smp.num_rows:
        name, names = _codes(smp.column("name"))
        dev = _np(smp.column("device"), -1, np.int32)
        t = _np(smp.column("start_ns"), 0)
        v = smp.column("value").fill_null(np.nan).to_numpy()
        units = smp.column("unit").cast(pa.string()).to_pylist()
        order = np.argsort(t, kind="stable")
        for code, nm in enumerate(names):
            sel = order[name[order] == code]
            for d in np.unique(dev[sel]):
                idx = sel[dev[sel] == d]
                key = nm if d < 0 else f"{nm}@{d}"  # per-GPU counters stay apart
                samples[key] = Samples(t[idx], v[idx], units[idx[0]] or "")
    return Frame(ranks, samples, dict(metadata or {}))
