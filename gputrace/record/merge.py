"""Merge the shards of one run into a single trace file, atomically."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from gputrace.trace.reader import Trace, _weight, load, merge_metadata
from gputrace.trace.schema import TraceFormatError
from gputrace.trace.writer import write_trace


@dataclass
class MergeResult:
    path: str
    rows: int
    shards: int
    metadata: dict[str, Any]
    rows_by_cat: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _load_readable(shard_dir: str) -> Trace:
    """Every shard that can be read; a process killed before its first batch leaves a shard
    with no complete schema, which holds no events: skip it with a warning."""
    good, skipped = [], []
    for name in sorted(os.listdir(shard_dir)):
        if not name.endswith(".arrow"):
            continue
        path = os.path.join(shard_dir, name)
        try:
            good.append(load(path))
        except TraceFormatError as e:
            skipped.append(f"{name}: skipped, nothing readable in it ({e})")
    if not good:
        raise TraceFormatError(f"no readable shard in {shard_dir}")
    table = pa.concat_tables([t.table for t in good], promote_options="permissive")
    md = merge_metadata([t.metadata for t in good])
    return Trace(table, md, [s for t in good for s in t.sources],
                 [w for t in good for w in t.warnings] + skipped)


def merge_shards(shard_dir: str, out: str, top: dict[str, Any] | None = None,
                 remove: bool = True) -> MergeResult:
    """Read every shard in shard_dir (recovering truncated ones), sort by time, write `out`.

    `top` overrides top-level metadata (the recording process's view of the run).
    The shard directory is removed only after the merged file is safely in place.
    """
    try:
        trace = load(shard_dir)
    except TraceFormatError:
        trace = _load_readable(shard_dir)
    table = trace.table
    if table.num_rows:
        table = table.take(pc.sort_indices(table, [("start_ns", "ascending")]))
    md = merge_metadata(trace.metadata.get("shards") or [trace.metadata])
    if top:
        md.update({k: v for k, v in top.items() if k != "collectors"})
        collectors = dict(md.get("collectors") or {})
        for name, info in (top.get("collectors") or {}).items():
            # a shard that tried a collector knows better than the outside guess
            if name not in collectors or _weight(info) > _weight(collectors[name]):
                collectors[name] = info
        md["collectors"] = collectors
    if trace.warnings:
        md["recovered"] = trace.warnings
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        write_trace(tmp, md, table=table)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    counts = pc.value_counts(table.column("cat").cast("string").combine_chunks()) \
        if table.num_rows else []
    by_cat = {c["values"].as_py(): c["counts"].as_py() for c in counts}
    if remove:
        shutil.rmtree(shard_dir, ignore_errors=True)
    return MergeResult(out, table.num_rows, len(trace.sources), md, by_cat, trace.warnings)
