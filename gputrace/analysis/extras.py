"""What lies beside the analyzers' results: a windowed recording's `window` and `run` (with
its `window_missed` finding), `memory` (with its findings), `flops` (with its finding) and
`hangs` (the collectives some rank waited in too long, each a finding). report.document
puts them in the `analyze --json` document and the report's charts.

They are made from what the analysis kept of the rows as it read them (Analysis.held,
analyzers.extras.held), for any rank, with no read of the trace. One kind of input is read
again: trace files the analysis could not read rank by rank (a file whose record batches
mix ranks, or one truncated or damaged, which the analysis read whole, recovering what it
could), whose memory samples, FLOP count and `flight` instants are read from the files as
they always were (`_columns`, document_flops, `_read`: a file that cannot be read that way
has no such section), so that what they say of those files stays what it was; an Analysis
that holds nothing (not made by analyzers.analyze) is read the same way."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from gputrace.analyzers.extras.memory import COLUMNS as _MEMORY_COLUMNS


@dataclass(frozen=True)
class Beside:
    """What extras() made for one rank, kept with the analysis (Analysis.beside) so that
    the terminal, `--json`, the API and the report read the one result."""

    rank: int                                  # the rank it was made for
    doc: dict[str, Any]                        # `window` and `run`, `memory`, `flops`, `hangs`
    memory_rows: list[Any] | None = None       # the memory samples (the report's chart)


def beside(a: Any, rank: int | None, inputs: Sequence[str], rows: bool = False) -> Beside:
    """What lies beside the analysis `a` for `rank` (None: the rank shown), with the
    memory samples where `rows`: the one the analysis holds where it was made for that rank
    (and holds the rows asked for), else made now."""
    shown = rank if rank is not None else a.main.rank
    held = getattr(a, "beside", None)
    if isinstance(held, Beside) and held.rank == shown and \
            (not rows or held.memory_rows is not None):
        return held
    kept: list[Any] | None = [] if rows else None
    return Beside(shown, extras(a, shown, inputs, kept), kept)


def extras(a: Any, rank: int | None, inputs: Sequence[str],
           rows: list[Any] | None = None) -> dict[str, Any]:
    """`window` and `run` (a windowed recording only), `memory`, `flops` and `hangs` of
    the analysis `a` of the trace `inputs`; `rows`: a list that gets the memory samples
    (for the chart)."""
    from gputrace.analysis.document_flops import flops_doc
    from gputrace.analysis.inputs import load_inputs
    from gputrace.analyzers.extras import hangs
    from gputrace.analyzers.extras.held import Held
    from gputrace.analyzers.extras.memory import analyze_memory, empty, memory_rows
    from gputrace.analyzers.extras.window import (
        analyze_window,
        captured,
        series_of,
        stored_of,
        window_doc,
        window_of,
    )
    from gputrace.trace.reader import unclosed

    shown = rank if rank is not None else a.main.rank
    held = a.held if isinstance(getattr(a, "held", None), Held) else None
    files = held.files if held is not None and held.files is not None else \
        all(p.endswith(".arrow") and os.path.isfile(p) for p in inputs)
    # what the analysis kept stands for every input but trace files it read whole (above)
    kept = held if held is not None and (held.ranked or not files) else None
    out: dict[str, Any] = {}
    present = None
    if window_of(a.metadata) is None:
        if kept is not None:   # every input the pass read: its samples and instants
            mem = flight = kept.rows
            present = kept.present
        elif files:
            mem, flight = _columns(inputs), _read(inputs, hangs.COLUMNS, _flight)
        elif any(unclosed(p) is not None for p in inputs):
            mem = flight = load_inputs(list(inputs), quiet=True).table
        else:
            mem = flight = None
    elif held is not None:     # every row of a windowed recording's was kept
        mem = flight = held.rows
        present = held.present
        at = stored_of(present, shown)
        out.update(window_doc(held.series.get(shown) or series_of([]), captured(mem, at),
                              a.metadata, shown) or {})
    else:
        mem = flight = load_inputs(list(inputs), quiet=True).table
        out.update(analyze_window(mem, a.metadata, shown) or {})
    out["memory"] = analyze_memory(mem, shown, a.metadata, present) if mem is not None \
        else empty()
    if rows is not None and mem is not None:
        rows.extend(memory_rows(mem, present))
    out["flops"] = flops_doc(a, shown, inputs, kept)
    out["hangs"] = hangs.as_json(hangs.find(hangs.rows_of(flight)))
    return out


def _flight(b: pa.RecordBatch) -> pa.RecordBatch:
    import pyarrow.compute as pc

    return b.filter(pc.and_(pc.equal(b.column("kind").cast(pa.string()), "instant"),
                            pc.equal(b.column("cat").cast(pa.string()), "flight"))
                    .fill_null(False))


def more_findings(more: dict[str, Any]) -> list[Any]:
    """The findings of what extras() made (analyzers.Finding): the hangs', the window's,
    memory's and the FLOP count's."""
    from gputrace.analyzers.findings.findings_memory import memory_findings
    from gputrace.analyzers.findings.rules import Finding

    out = [Finding("collective_hang", "high", h["message"])
           for h in (more.get("hangs") or {}).get("collectives", [])]
    if "run" in more and more["run"]["finding"]:
        out.append(Finding("window_missed", "moderate", more["run"]["finding"]))
    if (more.get("flops") or {}).get("finding"):
        out.append(Finding("layers_below_peak", "moderate", more["flops"]["finding"]))
    return out + memory_findings(more["memory"])


def _columns(inputs: Sequence[str]) -> pa.Table | None:
    """The rows the memory analysis reads, of trace files only: the samples, and the first
    row of each rank in each batch (its rank -1 is rank 0 only where no row says 0:
    window.stored_rank), a batch at a time, read, not mapped (every row of the columns at
    once peaked at ~100 B per event of the trace beside the analysis); None for other
    inputs, or a file that cannot be read."""
    import numpy as np
    import pyarrow.compute as pc

    def kept(b: pa.RecordBatch) -> pa.RecordBatch:
        m = pc.equal(b.column("kind").cast(pa.string()), "sample").fill_null(False)
        m = m.to_numpy(zero_copy_only=False).copy()
        m[np.unique(b.column("rank").fill_null(-(2**31)).to_numpy(), return_index=True)[1]] = True
        return b.filter(pa.array(m))

    return _read(inputs, _MEMORY_COLUMNS, kept)


def _read(inputs: Sequence[str], columns: Sequence[str],
          keep: Any) -> pa.Table | None:
    """`columns` of the trace files' rows that `keep` (a record batch's filter) keeps, a
    batch at a time; None for other inputs, or a file that cannot be read (truncated)."""
    parts = []
    for p in inputs:
        if not (p.endswith(".arrow") and os.path.isfile(p)):
            return None
        try:
            with pa.OSFile(p) as src:
                r = pa.ipc.open_file(src)
                idx = [r.schema.get_field_index(c) for c in columns]
                r = pa.ipc.open_file(src, options=pa.ipc.IpcReadOptions(
                    included_fields=idx))
                parts.append(pa.Table.from_batches(
                    [keep(r.get_batch(i)) for i in range(r.num_record_batches)], r.schema))
        except (OSError, pa.ArrowException):
            return None        # a truncated file: no such section rather than a full read
    return pa.concat_tables(parts, promote_options="permissive") if parts else None
