"""End of a recording: merging the processes' shards into one trace, time and peak memory.

`gputrace record` (and an embedded Session) merges every process's shard into one file
sorted by rank when the job ends, on the job's own node: its memory should follow the
largest rank, not the whole run. Synthetic shards (one per rank, in small batches, as the
recorders leave them) of each size are merged by `merge_shards`, in a process of its own.

    python bench/merge.py [--sizes 1e6,1e7] [--ranks 8] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import PY, machine, run, table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth  # noqa: E402

MERGE = "import sys; from gputrace.record.merge import merge_shards; " \
        "merge_shards(sys.argv[1], sys.argv[2], remove=False)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e6,1e7")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    sizes = [2e4] if a.tiny else [float(x) for x in a.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            shards = Path(tmp) / f"shards-{size:.0e}"
            shards.mkdir()
            n = synth.write_arrow(shards, int(size), a.ranks, shards=True)
            out = Path(tmp) / f"merged-{size:.0e}.arrow"
            _, p = run([PY, str(Path(__file__).parent / "measure.py"), PY, "-c", MERGE,
                        str(shards), str(out)])
            m = json.loads(p.stdout)
            if m["rc"] != 0:
                raise SystemExit(f"merge failed: {m['stderr']}")
            in_bytes = sum(f.stat().st_size for f in shards.iterdir())
            rows.append([f"{n:.0e}", f"{a.ranks}", f"{m['wall_s']:.2f} s",
                         f"{m['peak_rss_bytes'] / 2**20:.0f} MiB",
                         f"{m['peak_rss_bytes'] / n:.0f} B",
                         f"{in_bytes / 2**20:.0f} MiB", f"{out.stat().st_size / 2**20:.0f} MiB"])
    print(table("Merge of a recording's shards (merge_shards, in its own process)",
                ["events", "ranks", "time", "peak RSS", "RSS/event", "shards", "merged"], rows))
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
