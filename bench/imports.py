"""Import speed and memory: `gputrace import` of Kineto JSON and of Nsight Systems SQLite,
wall time per event and peak RSS against the size of the input.

Kineto: synthetic traces (bench/synth.py, one JSON file per rank, a cudaLaunchKernel beside
each GPU event as Kineto writes it) at each size, and the real Kineto traces in
../shared/data/kineto (decompressed first, so the text's size is what is read). nsys: the
real export ../shared/data/nsys/mfu_2gpu_before.sqlite and copies of it made N times longer
(its kernels, copies, runtime calls, NVTX ranges, memsets and synchronizations repeated,
each repetition later by the length of the original, correlation ids kept apart).

An event is one element of `traceEvents` (every phase type) for Kineto and one row of the
tables read for nsys. Time is the whole command (interpreter start included); peak RSS is
the command's (`RUSAGE_CHILDREN`). Goals: <= 5 us per event, peak RSS <= 2x the JSON text.

    python bench/imports.py [--kineto-sizes 1e5,1e6,3e6] [--ranks 4] [--nsys-copies 1,10,100]
                            [--tiny]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, machine, run, table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
NSYS_TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
               "CUPTI_ACTIVITY_KIND_MEMSET", "CUPTI_ACTIVITY_KIND_RUNTIME",
               "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "NVTX_EVENTS")


def measure(cmd: list[str], timeout: float = 3600) -> dict:
    _, p = run([PY, str(Path(__file__).parent / "measure.py"), *cmd], timeout=timeout)
    m = json.loads(p.stdout)
    if m["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {m['stderr']}")
    return m


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def kineto_events(files: list[Path]) -> int:
    n = 0
    for f in files:
        with open(f, "rb") as src:
            while chunk := src.read(1 << 24):
                n += chunk.count(b'"ph":') + chunk.count(b'"ph" :')
    return n


def nsys_copies(src: Path, dst: Path, copies: int) -> int:
    """src made `copies` times longer; returns the rows of the tables the importer reads."""
    shutil.copy(src, dst)
    db = sqlite3.connect(dst)
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    lo, hi = db.execute("SELECT MIN(start), MAX(end) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()
    span = hi - lo + 1
    corr = max(db.execute(f"SELECT MAX(correlationId) FROM {t}").fetchone()[0] or 0
               for t in NSYS_TABLES if t in tables and t != "NVTX_EVENTS") + 1
    for t in NSYS_TABLES:
        if t not in tables:
            continue
        info = db.execute(f"PRAGMA table_info({t})").fetchall()
        last = db.execute(f"SELECT MAX(rowid) FROM {t}").fetchone()[0] or 0
        for k in range(1, copies):
            cols, exprs = [], []
            for _, name, _, _, _, pk in info:
                if pk:
                    continue           # a new row id
                cols.append(name)
                exprs.append(f"{name} + {k * span}" if name in ("start", "end") else
                             f"{name} + {k * corr}" if name == "correlationId" else name)
            db.execute(f"INSERT INTO {t} ({', '.join(cols)}) SELECT {', '.join(exprs)} "
                       f"FROM {t} WHERE rowid <= {last}")
    db.commit()
    n = sum(db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in NSYS_TABLES
            if t in tables)
    db.execute("VACUUM")
    db.close()
    return n


def row(what: str, events: int, nbytes: int, m: dict) -> list[str]:
    return [what, f"{events:.3g}", mib(nbytes), f"{m['wall_s']:.2f} s",
            f"{m['wall_s'] / events * 1e6:.2f} us", mib(m["peak_rss_bytes"]),
            f"{m['peak_rss_bytes'] / nbytes:.2f}x"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kineto-sizes", default="1e5,1e6,3e6")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--nsys-copies", default="1,10,100")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    sizes = [2e4] if a.tiny else [float(x) for x in a.kineto_sizes.split(",")]
    copies = [1, 3] if a.tiny else [int(x) for x in a.nsys_copies.split(",")]
    header = ["input", "events", "input size", "time", "per event", "peak RSS", "RSS/input"]
    kin, nsys = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.arrow")
        for n in sizes:
            d = Path(tmp) / f"k{n:.0e}"
            synth.write_kineto(d, int(n), a.ranks)
            files = sorted(d.iterdir())
            events = kineto_events(files)
            nbytes = sum(f.stat().st_size for f in files)
            m = measure([PY, "-m", "gputrace", "import", str(d), "-o", out])
            kin.append(row(f"synthetic, {a.ranks} ranks", events, nbytes, m))
            shutil.rmtree(d)
        for src in ([] if a.tiny else sorted((DATA / "kineto").glob("*.json.gz"))):
            f = Path(tmp) / src.name.removesuffix(".gz")
            with gzip.open(src, "rb") as z, open(f, "wb") as o:
                shutil.copyfileobj(z, o)
            m = measure([PY, "-m", "gputrace", "import", str(f), "-o", out])
            kin.append(row(f"real: {f.name}", kineto_events([f]), f.stat().st_size, m))
            f.unlink()
        src = DATA / "nsys" / "mfu_2gpu_before.sqlite"
        for k in copies:
            db = Path(tmp) / f"x{k}.sqlite"
            events = nsys_copies(src, db, k)
            m = measure([PY, "-m", "gputrace", "import", str(db), "-o", out])
            nsys.append(row(f"{src.name} x{k}", events, db.stat().st_size, m))
            db.unlink()
    print(table("Kineto JSON import (gputrace import)", header, kin))
    print()
    print(table("Nsight Systems SQLite import (gputrace import)", header, nsys))
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
