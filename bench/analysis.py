"""Analysis speed, memory and trace size against the peers, on the same synthetic events.

For each size: the trace as gputrace Arrow and as Kineto JSON (what the PyTorch profiler
writes, and what Holistic Trace Analysis reads); `gputrace analyze --json` time and peak RSS;
`gputrace import` of the JSON, time and peak RSS; with --hta-python, HTA's comm-comp
overlap and temporal breakdown on the JSON; bytes per event of each format. Goals: 1e7
events in <= 5 s and <= 1.5 GB; >= 30x faster and >= 10x less memory than HTA;
<= 10 B/event.

    python bench/analysis.py [--sizes 1e5,1e6,1e7] [--json-max 1e6] [--hta-python PY] [--tiny]

HTA is not a dependency: install it in its own environment only for this benchmark, pinned
to what it runs with (python -m venv /tmp/hta &&
/tmp/hta/bin/pip install -r bench/requirements-hta.txt) and pass
--hta-python /tmp/hta/bin/python.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path

from common import PY, machine, run, table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth  # noqa: E402

HTA_SCRIPT = """
import sys
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
a.get_comm_comp_overlap(visualize=False)
a.get_temporal_breakdown(visualize=False)
"""


def measure(cmd: list[str], timeout: float) -> dict:
    try:
        _, p = run([PY, str(Path(__file__).parent / "measure.py"), *cmd], timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a peer that cannot finish is a result
        return {"rc": -1, "error": str(e)[:200]}
    return json.loads(p.stdout)


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e5,1e6,1e7")
    ap.add_argument("--json-max", type=float, default=1e6,
                    help="largest size also written as Kineto JSON (JSON is slow to write)")
    ap.add_argument("--hta-python", help="a Python with holistictraceanalysis installed")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--ranks", type=int, default=4,
                    help="ranks the events are spread over (one Kineto file per rank)")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    sizes = [int(float(x)) for x in ("2e4" if a.tiny else a.sizes).split(",")]
    speed, size_rows, imports = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            arrow = Path(tmp) / f"t{n}.arrow"
            events = synth.write_arrow(arrow, n, a.ranks)
            g = measure([PY, "-m", "gputrace", "analyze", "--json", str(arrow)], a.timeout)
            if g.get("rc") != 0:
                raise SystemExit(f"gputrace analyze failed at {n}: {g}")
            row = [f"{events:.2g}", f"{g['wall_s']:.2f} s", fmt_bytes(g["peak_rss_bytes"])]
            sz = [f"{events:.2g}", f"{arrow.stat().st_size / events:.1f}"]
            if n <= a.json_max:
                jdir = Path(tmp) / f"k{n}"
                synth.write_kineto(jdir, n, a.ranks)
                jbytes = sum(f.stat().st_size for f in jdir.iterdir())
                gz = 0
                for f in jdir.iterdir():
                    with open(f, "rb") as src, gzip.open(f"{f}.gz", "wb", compresslevel=6) as d:
                        shutil.copyfileobj(src, d)
                    gz += Path(f"{f}.gz").stat().st_size
                    Path(f"{f}.gz").unlink()
                sz += [f"{jbytes / events:.1f}", f"{gz / events:.1f}"]
                m = measure([PY, "-m", "gputrace", "import", str(jdir), "-o",
                             str(Path(tmp) / "imported.arrow")], a.timeout)
                if m.get("rc") != 0:
                    raise SystemExit(f"gputrace import failed at {n}: {m}")
                imports.append([f"{events:.2g}", f"{m['wall_s']:.1f} s",
                                fmt_bytes(m["peak_rss_bytes"]), fmt_bytes(jbytes),
                                f"{m['peak_rss_bytes'] / jbytes:.2f}",
                                f"{m['peak_rss_bytes'] / events:.0f}"])
                (Path(tmp) / "imported.arrow").unlink()
                if a.hta_python:
                    h = measure([a.hta_python, "-c", HTA_SCRIPT, str(jdir)], a.timeout)
                    if h.get("rc") == 0:
                        row += [f"{h['wall_s']:.2f} s", fmt_bytes(h["peak_rss_bytes"]),
                                f"{h['wall_s'] / g['wall_s']:.0f}x",
                                f"{h['peak_rss_bytes'] / g['peak_rss_bytes']:.1f}x"]
                    else:
                        why = (h.get("error") or h.get("stderr") or "").strip().splitlines()
                        row += ["did not finish", (why[-1] if why else "")[:40], "", ""]
                shutil.rmtree(jdir)
            else:
                sz += ["-", "-"]
            speed.append(row + [""] * (7 - len(row)))
            size_rows.append(sz)
            arrow.unlink()
    print(table("Analysis: gputrace analyze --json vs HTA (comm-comp overlap + temporal "
                f"breakdown), same events, {a.ranks} ranks",
                ["events", "gputrace", "peak RSS", "HTA", "HTA RSS", "time ratio", "RSS ratio"],
                speed))
    print()
    print(table("Trace size, bytes per event", ["events", "gputrace .arrow", "Kineto JSON",
                                                "JSON.gz"], size_rows))
    if imports:
        print()
        print(table("Import: gputrace import of the Kineto JSON",
                    ["events", "time", "peak RSS", "JSON text", "RSS / JSON", "RSS B/event"],
                    imports))
    print(f"machine: {machine()}")
    if not a.hta_python:
        print("HTA columns empty: pass --hta-python to compare (see the module docstring)")


if __name__ == "__main__":
    main()
