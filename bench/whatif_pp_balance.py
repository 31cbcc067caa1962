"""The pipeline's layers-balanced what-if against the run it predicts.

Real 2-stage `torch.distributed.pipelining` jobs over gloo on the CPU
(tests/jobs/pp_train.py), one model cut unevenly (`--split`, e.g. 6 and 2 blocks) and
evenly (4 and 4): each uneven run's "layers balanced across stages" what-if
(`pp_whatif._balanced`, replayed by pipesim with the recorded schedule and microbatches)
against the even run's iteration (stage 0's, as bench/whatif_pp.py), beside the uneven
run's own and the cores other work kept busy.

    python bench/whatif_pp_balance.py [--schedules gpipe,1f1b] [--splits 6,2:2,6]
        [--microbatches 4] [--iterations 8] [--width 1024] [--batch 256] [--rounds 1]
        [--quiet SECONDS] [--keep DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, machine, table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from whatif_pp import BUSY_OTHERS, SCHEDULES, pipeline, run_recording  # noqa: E402

JOB = ROOT / "tests" / "jobs" / "pp_train.py"
BALANCED = "layers balanced across stages"


def record(out: Path, sched: str, split: str, a: argparse.Namespace) -> tuple[Path, float]:
    """The trace of `sched` with the model cut as `split`, and the cores other processes
    kept busy while it was recorded."""
    name = f"{sched}-{split.replace(',', '-')}"
    trace = out / f"{name}.arrow"
    cmd = [PY, "-m", "gputrace", "record", "-q", "-f", "-o", str(trace), "--", PY, "-m",
           "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB),
           str(out / name), "--schedule", sched, "--microbatches", str(a.microbatches),
           "--iterations", str(a.iterations), "--split", split, "--width", str(a.width),
           "--batch", str(a.batch)]
    return trace, run_recording(cmd, a.quiet)


def even(split: str) -> str:
    """The even cut of the same blocks over as many stages."""
    parts = [int(x) for x in split.split(",")]
    total, n = sum(parts), len(parts)
    if total % n:
        raise SystemExit(f"--splits {split}: {total} blocks do not cut evenly in {n}")
    return ",".join([str(total // n)] * n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--splits", default="6,2:2,6", help="uneven cuts, colon-separated")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quiet", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--tiny", action="store_true",
                    help="a small model, 1F1B, 5 and 1 blocks, 6 iterations")
    a = ap.parse_args()
    if a.tiny:
        a.schedules, a.splits, a.iterations, a.width, a.batch = "1f1b", "5,1", 6, 512, 256
    scheds = [s for s in a.schedules.split(",") if s]
    if any(s not in ("gpipe", "1f1b") for s in scheds):
        raise SystemExit(f"--schedules {a.schedules}: one stage per rank only (gpipe, 1f1b; "
                         f"the layers are rebalanced between stages of one rank each, of "
                         f"{', '.join(SCHEDULES)})")
    splits = [s for s in a.splits.split(":") if s]
    out = a.keep or Path(tempfile.mkdtemp(prefix="gputrace-balance-"))
    out.mkdir(parents=True, exist_ok=True)
    rows, errs = [], []
    try:
        for rnd in range(a.rounds):
            for sched in scheds:
                (out / f"round{rnd}").mkdir(exist_ok=True)
                runs = {sp: record(out / f"round{rnd}", sched, sp, a)
                        for sp in {*splits, *map(even, splits)}}
                for sp in splits:
                    src, others = runs[sp]
                    dst, d_others = runs[even(sp)]
                    pl, meas = pipeline(src), pipeline(dst).stages[0].t_iter
                    w = [x for x in pl.what_if if x.what.startswith(BALANCED)]
                    cut = w[0].what.split(": ")[1].split(" layers")[0] if w else ""
                    # the even run's layers: each stage's blocks, the last with its head
                    blocks = [int(x) for x in even(sp).split(",")]
                    target = " + ".join(str(b + (k == len(blocks) - 1))
                                        for k, b in enumerate(blocks))
                    if w and cut != target:     # the what-if cut elsewhere: no run of it
                        rows.append([str(rnd), sched, sp, even(sp),
                                     f"{pl.stages[0].t_iter * 1e3:.0f}",
                                     f"{w[0].t_iter * 1e3:.0f} ({cut})", f"{meas * 1e3:.0f}",
                                     "not that cut", ""])
                        continue
                    if not w:
                        rows.append([str(rnd), sched, sp, even(sp), f"{pl.stages[0].t_iter * 1e3:.0f}",
                                     "none", f"{meas * 1e3:.0f}", "", ""])
                        continue
                    err = w[0].t_iter / meas - 1
                    errs.append(err)
                    busy = max(others, d_others)
                    rows.append([str(rnd), sched, sp, even(sp), f"{pl.stages[0].t_iter * 1e3:.0f}",
                                 f"{w[0].t_iter * 1e3:.0f}", f"{meas * 1e3:.0f}",
                                 f"{err:+.1%}", f"{busy:.2f}" + (" (busy)" if busy > BUSY_OTHERS
                                                                  else "")])
    finally:
        if a.keep is None:
            shutil.rmtree(out, ignore_errors=True)
    print(table("Layers balanced across stages: the what-if of each uneven cut against the "
                "run of the even one (t_iter: stage 0's, ms)",
                ["round", "schedule", "from", "to", "from t_iter", "predicted", "measured",
                 "error", "others' cores"], rows))
    if errs:
        print(f"{len(errs)} predictions, |error| at most {max(map(abs, errs)):.1%}, "
              f"{sum(abs(e) <= 0.10 for e in errs)} within 10 %, "
              f"range {min(errs):+.1%} .. {max(errs):+.1%}")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
