"""Merge the shards of one run into a single trace file, atomically."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import pyarrow.compute as pc

from gputrace.trace.reader import collector_weight, load, merge_metadata
from gputrace.trace.writer import write_by_rank


@dataclass
class MergeResult:
    path: str
    rows: int
    shards: int
    metadata: dict[str, Any]
    rows_by_cat: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def merge_shards(shard_dir: str, out: str, top: dict[str, Any] | None = None,
                 remove: bool = True) -> MergeResult:
    """Read every shard in shard_dir (recovering truncated ones), write `out` sorted by rank
    and time, one rank per record batch (analysis then reads one rank at a time).

    `top` overrides top-level metadata (the recording process's view of the run).
    The shard directory is removed only after the merged file is safely in place.
    """
    trace = load(shard_dir, skip_unreadable=True)
    table = trace.table
    md = merge_metadata(trace.metadata.get("shards") or [trace.metadata])
    if top:
        md.update({k: v for k, v in top.items() if k != "collectors"})
        collectors = dict(md.get("collectors") or {})
        for name, info in (top.get("collectors") or {}).items():
            # a shard that tried a collector knows better than the outside guess
            if name not in collectors or collector_weight(info) > collector_weight(collectors[name]):
                collectors[name] = info
        md["collectors"] = collectors
    if trace.warnings:
        md["recovered"] = trace.warnings
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        write_by_rank(tmp, md, table)
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
