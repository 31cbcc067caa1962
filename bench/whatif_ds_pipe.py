"""DeepSpeed's pipeline engine: the microbatch what-ifs of a run recorded with
`record --pp-probe` against the runs they predict.

Real 2-rank DeepSpeed pipelines over gloo on the CPU (tests/jobs/ds_pipe_train.py under
torchrun: 8 Linear(1024) layers in 2 stages, one global batch of 256 rows as 2, 4 and 8
microbatches), one recording per count in each round; each run's what-if at half and twice
its count (`analyze`'s `parallelism.pipeline.what_if`, the compute probed) against the run
at that count of the same round (gputrace's t_iter of stage 0's rank, the iteration the
replay predicts). Beside it the same what-if with the engine's own work per microbatch kept
as measured (`pp_whatif.own_scales` off) and the proportional one (the probe not used).

    python bench/whatif_ds_pipe.py [--rounds 3] [--iterations 10] [--keep DIR | --reuse DIR]
        [--tiny]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, machine, table

JOB = ROOT / "tests" / "jobs" / "ds_pipe_train.py"
COUNTS = (2, 4, 8)
GLOBAL = 256


def record(prefix: Path, m: int, a: argparse.Namespace) -> None:
    subprocess.run([PY, "-m", "gputrace", "record", "-q", "-f", "-o", f"{prefix}.arrow",
                    "--pp-probe", "--", PY, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", str(JOB), str(prefix), "--microbatches", str(m),
                    "--global-batch", str(a.global_batch), "--iterations", str(a.iterations),
                    "--width", str(a.width), "--layers", "8"], check=True,
                   capture_output=True, timeout=1200)


def predictions(runs: dict[int, Path], variant: str) -> list[tuple[int, int, float, float]]:
    """(from, to, predicted, measured) seconds for each run's what-ifs at the others'
    counts, the model as `variant` makes it."""
    sys.path.insert(0, str(ROOT))
    from gputrace import load
    from gputrace.analyzers import analyze
    from gputrace.analyzers.parallel.pp import pp_probed, pp_whatif

    keep = pp_probed.of_metadata, pp_whatif.own_scales
    if variant == "proportional":
        pp_probed.of_metadata = lambda md: None
    elif variant == "own kept":
        pp_whatif.own_scales = lambda pl: False
    try:
        got = {m: analyze(load(f"{p}.arrow")) for m, p in runs.items()}
    finally:
        pp_probed.of_metadata, pp_whatif.own_scales = keep
    meas = {m: float(a.main.breakdown["t_iter"].mean) for m, a in got.items()}
    out = []
    for m, a in got.items():
        pl = a.main.parallel["pp"]
        for w in pl.what_if:
            if w.schedule == pl.schedule and w.microbatches in meas and w.microbatches != m:
                out.append((m, w.microbatches, w.t_iter, meas[w.microbatches]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--reuse", type=Path)
    ap.add_argument("--tiny", action="store_true",
                    help="one round of 2 and 4 microbatches of a small model: that it runs")
    a = ap.parse_args()
    a.counts, a.width, a.global_batch = COUNTS, 1024, GLOBAL
    if a.tiny:
        a.rounds, a.iterations, a.counts, a.width, a.global_batch = 1, 4, (2, 4), 128, 32
    out = a.reuse or a.keep or Path(tempfile.mkdtemp(prefix="whatif-ds-pipe-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    rows, errs = [], {"probed": [], "own kept": [], "proportional": []}
    for r in range(a.rounds):
        runs = {m: out / f"r{r}m{m}" for m in a.counts}
        if not a.reuse:
            for m, p in runs.items():
                record(p, m, a)
        by = {v: predictions(runs, v) for v in errs}
        for i, (src, dst, _, meas) in enumerate(by["probed"]):
            row = [str(r), str(src), str(dst), f"{meas * 1e3:.1f}"]
            for v in errs:
                e = by[v][i][2] / by[v][i][3] - 1
                errs[v].append(e)
                row.append(f"{by[v][i][2] * 1e3:.1f} ({e:+.1%})")
            rows.append(row)
    print(table("DeepSpeed pipeline microbatch what-ifs against the runs they predict "
                f"(global batch {a.global_batch})", ["round", "from", "to", "measured ms", "probed",
                                             "probed, own work kept", "proportional"], rows))
    for v, e in errs.items():
        if e:
            ab = [abs(x) for x in e]
            print(f"{v}: {len(e)} predictions, median |error| {statistics.median(ab):.1%}, "
                  f"{min(e):+.1%} .. {max(e):+.1%}, within 10 %: "
                  f"{sum(x <= 0.10 for x in ab)}")


if __name__ == "__main__":
    main()
