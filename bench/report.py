"""HTML report generation time and page size on synthetic traces (see synth.py).

For each size: `gputrace analyze --json` and `gputrace report -o page.html` on the same
trace, the median wall time of --repeats runs each (the report's extra cost is the
difference), the report's peak RSS and the page's size. The Vega bundle is made once per
machine (vl-convert, ~2 s) and cached; the first report in a fresh cache directory is timed
apart. Goal: <= 2 s for 1e6 events.

    python bench/report.py [--sizes 1e5,1e6] [--repeats 3] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from common import PY, machine, run, table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth  # noqa: E402


def measure(cmd: list[str], env: dict[str, str]) -> dict:
    _, p = run([PY, str(Path(__file__).parent / "measure.py"), *cmd], env=env)
    out = json.loads(p.stdout)
    if out["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {out['stderr']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e5,1e6")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    sizes = [int(float(x)) for x in ("2e4" if a.tiny else a.sizes).split(",")]
    repeats = 1 if a.tiny else a.repeats
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GPUTRACE_CACHE_DIR=str(Path(tmp) / "cache"))
        for i, n in enumerate(sizes):
            arrow = Path(tmp) / f"t{n}.arrow"
            page = Path(tmp) / f"t{n}.html"
            events = synth.write_arrow(arrow, n, a.ranks)
            report = [PY, "-m", "gputrace", "report", str(arrow), "-o", str(page)]
            first = measure(report, env)["wall_s"] if i == 0 else None
            if first is not None:
                print(f"first report in a fresh cache (bundles Vega): {first:.2f} s")
            rep = [measure(report, env) for _ in range(repeats)]
            ana = [measure([PY, "-m", "gputrace", "analyze", "--json", str(arrow)], env)
                   for _ in range(repeats)]
            t_rep = statistics.median(r["wall_s"] for r in rep)
            t_ana = statistics.median(r["wall_s"] for r in ana)
            iters = synth.shape(n, a.ranks)
            rows.append([f"{events:.2g}", f"{a.ranks} x {iters}", f"{t_ana:.2f} s",
                         f"{t_rep:.2f} s", f"{t_rep - t_ana:+.2f} s",
                         f"{max(r['peak_rss_bytes'] for r in rep) / 2**20:.0f} MiB",
                         f"{page.stat().st_size / 1e6:.2f} MB"])
            arrow.unlink()
    print(table(f"Report: gputrace report vs analyze --json, median of {repeats}",
                ["events", "ranks x iterations", "analyze", "report", "difference",
                 "report RSS", "page"], rows))
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
