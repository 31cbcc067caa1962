"""The sharded what-if checked against the run it predicts.

Two real 2-rank FSDP2 jobs over gloo on the CPU (tests/jobs/fsdp_train.py, `fully_shard` on
each block and the root) are recorded with gputrace: one with reshard_after_forward=True,
one with False. Each predicts the other with `analyze`'s sharded replay (the
`reshard_after_forward=...` what-if), and the errors against the measured t_iter are
printed, with the replay of each run's own configuration (the model's error).

    python bench/whatif_fsdp.py [--iterations 20] [--blocks 4] [--width 256] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, machine, table

JOB = ROOT / "tests" / "jobs" / "fsdp_train.py"


def record(out: Path, mode: str, a: argparse.Namespace) -> Path:
    trace = out / f"{mode}.arrow"
    cmd = [PY, "-m", "gputrace", "record", "-f", "-o", str(trace), "--", PY, "-m",
           "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB),
           str(out / mode), "--mode", mode, "--iterations", str(a.iterations), "--blocks",
           str(a.blocks), "--width", str(a.width)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    return trace


def analysis(trace: Path) -> dict:
    p = subprocess.run([PY, "-m", "gputrace", "analyze", str(trace), "--json"], check=True,
                       capture_output=True, text=True, timeout=600)
    return json.loads(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--keep", type=Path)
    a = ap.parse_args()
    out = a.keep or Path(tempfile.mkdtemp(prefix="whatif-fsdp-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        runs = {m: analysis(record(out, m, a)) for m in ("fsdp2", "fsdp2-keep")}
        rows = []
        for src, dst, label in (("fsdp2", "fsdp2-keep", "reshard_after_forward=False"),
                                ("fsdp2-keep", "fsdp2", "reshard_after_forward=True")):
            s, d = runs[src], runs[dst]
            w = next(x for x in s["sharded"]["what_if"] if x["label"] == label)
            meas = d["breakdown"]["t_iter"]["mean"]
            rows.append([f"{src} -> {label}", f"{s['breakdown']['t_iter']['mean'] * 1e3:.1f}",
                         f"{w['t_iter'] * 1e3:.1f} [{(w['t_iter_low'] or 0) * 1e3:.1f}, "
                         f"{(w['t_iter_high'] or 0) * 1e3:.1f}]", f"{meas * 1e3:.1f}",
                         f"{w['t_iter'] / meas - 1:+.1%}",
                         f"{s['sharded']['baseline_error']:+.1%}"])
        print(machine())
        print(table("FSDP2 reshard_after_forward what-if against the run it predicts",
                    ["prediction", "own t_iter ms", "predicted ms [95 %]", "measured ms",
                     "error", "own replay error"], rows))
    finally:
        if a.keep is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
