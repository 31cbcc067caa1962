"""Merge the shards of one run into a single trace file, atomically."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from gputrace import progress
from gputrace.record.place import temporary
from gputrace.trace.reader import collector_weight, index_shards, merge_metadata
from gputrace.trace.writer import by_rank, write_ranks


@dataclass
class MergeResult:
    path: str
    rows: int
    shards: int
    metadata: dict[str, Any]
    rows_by_cat: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def merge_shards(shard_dir: str, out: str, top: dict[str, Any] | None = None,
                 remove: bool = True,
                 place: Callable[[str, str, dict[str, Any]], str] | None = None
                 ) -> MergeResult:
    """Read every shard in shard_dir (recovering truncated ones), write `out` sorted by rank
    and time, one rank per record batch (analysis then reads one rank at a time).

    Ranks are merged one at a time, each from the shards that hold it, so memory follows
    the largest rank, not the whole run. `top` overrides top-level metadata (the recording
    process's view of the run). The shard directory is removed only after the merged file
    is safely in place. `place(tmp, out, metadata)` puts the finished file where it goes
    and returns that path (default: `out`, replaced).
    """
    shards, warnings = index_shards(shard_dir)
    md = merge_metadata([s.metadata for s in shards])
    if top:
        world = md.get("world_size")
        md.update({k: v for k, v in top.items() if k != "collectors"})
        if isinstance(world, int) and world > (md.get("world_size") or -1):
            md["world_size"] = world   # the processes learned it (torch.distributed)
        collectors = dict(md.get("collectors") or {})
        for name, info in (top.get("collectors") or {}).items():
            # a shard that tried a collector knows better than the outside guess
            if name not in collectors or collector_weight(info) > collector_weight(collectors[name]):
                collectors[name] = info
        md["collectors"] = collectors
    if warnings:
        md["recovered"] = warnings
    tmp = temporary(out)
    by_cat: Counter[str] = Counter()
    rows = 0

    def ranks() -> Iterator[pa.Table]:
        nonlocal rows
        for rank in progress.each(sorted(set().union(*(s.ranks for s in shards))),
                                  f"merging {len(shards)} shards into {os.path.basename(out)}"
                                  " (ranks)"):
            table = by_rank(pa.concat_tables([s.read(rank) for s in shards if rank in s.ranks],
                                             promote_options="permissive"))
            rows += table.num_rows
            for c in pc.value_counts(table.column("cat").cast(pa.string())
                                     .combine_chunks()) if table.num_rows else []:
                by_cat[c["values"].as_py()] += c["counts"].as_py()
            yield table
            del table

    try:
        write_ranks(tmp, md, ranks())
        if place is None:
            os.replace(tmp, out)
        else:
            out = place(tmp, out, md)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if remove:
        shutil.rmtree(shard_dir, ignore_errors=True)
    return MergeResult(out, rows, len(shards), md, dict(by_cat), warnings)
