"""What the analysis keeps of a trace's rows, beside its figures, for what lies beside them
(analysis.extras builds `memory`, `flops`, `hangs`, and a windowed recording's `window` and
`run` from it), so that none of them reads the trace again: each frame's memory samples,
NVML's used-memory samples and `flight` and `window` instants (few rows: Frame.others as
`keep` leaves them) with the ranks its rows carry, and each rank's `flops` rows with its
layers' measured times and, in a windowed recording, its whole run's series. Small plain
data: a rank's part of the analysis comes back from a worker process with it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace.analyzers.extras import memory
from gputrace.analyzers.extras.layer_times import Times, of_spans

if TYPE_CHECKING:
    from gputrace.analyzers.core.frame import Spans

# the instants kept: the comm collector's (analyzers.extras.hangs) and the window's
# (`gputrace capture`, analyzers.extras.window.captured)
INSTANT_CATS = ("flight", "window")


@dataclass(frozen=True)
class FlopsRow:
    """A `flops` span of one rank (the iteration whose FLOPs it counted) and its layers'
    forward and backward time per analyzed iteration (layer_times), that iteration left
    out where the timings leave it out."""

    args: str | None
    start_ns: int
    end_ns: int
    times: Times


@dataclass(frozen=True)
class Held:
    """What the analysis kept for the sections beside it (Analysis.held)."""

    ranked: bool = False                  # the inputs were read rank by rank (intact files)
    present: tuple[int, ...] = ()         # the ranks the trace's rows carry, as stored
    rows: pa.Table | None = None          # the samples and instants `keep` keeps
    flops: dict[int, tuple[FlopsRow, ...]] = field(default_factory=dict)   # by rank
    series: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # by rank
    # every input was a trace file when it was read (analysis.run says; None: not told)
    files: bool | None = None


def keep(t: pa.Table) -> pa.Table | None:
    """Of a frame's samples and instants (frame.build's `others`): the memory samples,
    NVML's used memory, and the instants of INSTANT_CATS, dictionaries decoded; None where
    there are none."""
    t = t.filter(pc.or_(memory.is_memory(t), pc.and_(
        pc.equal(t["kind"].cast(pa.string()), "instant"),
        pc.is_in(t["cat"].cast(pa.string()), pa.array(INSTANT_CATS)))))
    if not t.num_rows:
        return None
    return pa.table({c: (t[c].cast(t[c].type.value_type) if pa.types.is_dictionary(t[c].type)
                         else t[c]).combine_chunks() for c in t.column_names})


def flops_rows(sp: Spans, skipped: int, left_out: int | None) -> tuple[FlopsRow, ...]:
    """A rank's `flops` spans, each with its layers' times over the rank's analyzed
    iterations (the first `skipped` are warm-up; `left_out`: the analyzed iteration whose
    FLOPs were counted, None where it is not among them)."""
    idx = np.flatnonzero(sp.of("flops"))
    if not idx.size:
        return ()
    out = []
    args = sp.args.take(pa.array(idx)).to_pylist()
    for i, a in zip(idx.tolist(), args, strict=True):
        s, e = int(sp.start[i]), int(sp.end[i])
        out.append(FlopsRow(a, s, e, of_spans(sp, skipped, (s, e) if left_out is not None
                                                else None)))
    return tuple(out)


def gather(frames: Iterable[tuple[pa.Table | None, tuple[int, ...]]],
           flops: dict[int, tuple[FlopsRow, ...]], series: dict[int, Any],
           ranked: bool) -> Held:
    """The run's Held from its frames' kept rows and ranks, and its ranks' flops rows and
    series."""
    present: set[int] = set()
    tables = []
    for rows, ranks in frames:
        present.update(ranks)
        if rows is not None:
            tables.append(rows)
    rows = None if not tables else tables[0] if len(tables) == 1 else \
        pa.concat_tables(tables, promote_options="permissive")
    return Held(ranked, tuple(sorted(present)), rows,
                {r: f for r, f in sorted(flops.items()) if f},
                {r: s for r, s in sorted(series.items()) if s is not None})
