"""The pipeline microbatch what-ifs against the runs they predict, inside one recording:
tests/jobs/pp_train.py on 2 ranks over gloo runs N iterations at A microbatches, N at B,
then N at A again (`--then B,A`: one schedule over new stages of the same modules per
block), under `gputrace record --steps 2:N-2` (the first A block in full detail, after two
iterations of warm-up: every other iteration keeps its time only). The what-if of that
window at B microbatches (`pp_whatif.predict`, the model `analyze` gives from one run: the
compute per microbatch proportional to its size, the schedule's own work per microbatch as
measured) predicts the B block's median iteration on the job's own clock (stage 0's rank,
the block's first two iterations left out: a new schedule's first step infers its shapes);
the second A block against the first says how far the machine's speed moved meanwhile.
The same what-if fitted with a calibrating run (`analyze --calibrate`: the window of
another recording of the set, of the same schedule at a third count C, neither A nor B)
against the same B block. Then, per block, a chunk's compute on the job's own clock: the
module's forward and the backward's autograd, wall and CPU seconds (the thread's: the wall
less its wait for a CPU behind other processes), medians per microbatch.

    python bench/whatif_pp_inside.py [--schedules gpipe,1f1b,interleaved]
        [--pairs 4:8,8:4,8:16,16:8] [--iterations 8] [--width 1024] [--batch 256]
        [--blocks 4] [--keep DIR | --reuse DIR] [--probe] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from common import PY, ROOT, machine

JOB = ROOT / "tests" / "jobs" / "pp_train.py"
CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
         "interleaved": "ScheduleInterleaved1F1B"}
SETTLE = 2     # a block's first iterations left out


def record(prefix: Path, sched: str, a: int, b: int, args: argparse.Namespace) -> None:
    n = args.iterations
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    subprocess.run([PY, "-m", "gputrace", "record", "-q", "-f", "-o", f"{prefix}.arrow",
                    *(["--pp-probe"] if args.probe else []), "--steps", f"{SETTLE}:{n - SETTLE}", "--", PY, "-m",
                    "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(JOB), str(prefix), "--schedule", sched, "--microbatches", str(a),
                    "--then", f"{b},{a}", "--iterations", str(n), "--width",
                    str(args.width), "--batch", str(args.batch), "--blocks",
                    str(args.blocks)], check=True, capture_output=True, text=True,
                   timeout=1800, env=env)


def blocks(prefix: Path, n: int) -> list[float]:
    """Each block's median iteration on the job's clock (stage 0's rank), seconds."""
    t = json.loads(Path(f"{prefix}.rank0.json").read_text())
    its = t["iterations"]
    return [float(np.median([(i["end"] - i["start"]) / 1e9
                             for i in its[k * n + SETTLE:(k + 1) * n]])) for k in range(3)]


def clock(prefix: Path, n: int) -> list[tuple[int, int, int, float, float, float, float]]:
    """Per rank and block: (rank, block, microbatches, the module's forward wall and CPU
    seconds, the autograd's wall and CPU seconds), medians per microbatch on the job's
    clock, each block's first SETTLE iterations left out."""
    out = []
    for r in (0, 1):
        t = json.loads(Path(f"{prefix}.rank{r}.json").read_text())
        its = t["iterations"]
        for k in range(len(its) // n):
            keep = set(range(k * n + SETTLE, (k + 1) * n))
            fw = [f for f in t["forwards"] if f["it"] in keep and f.get("cpu_s") is not None]
            bw = [c for c in t["chunks"] if c["it"] in keep and c.get("autograd_cpu_s")]
            if not fw or not bw:
                continue
            out.append((r, k, its[k * n]["microbatches"],
                        float(np.median([f["s"] for f in fw])),
                        float(np.median([f["cpu_s"] for f in fw])),
                        float(np.median([c["autograd_s"] for c in bw])),
                        float(np.median([c["autograd_cpu_s"] for c in bw]))))
    return out


def slowdown(prefix: Path, n: int, k: int) -> float:
    """Block k's compute, wall over CPU seconds on the job's clock (the module's forward
    and the autograd, both ranks): how much longer the machine's load made it (1: no wait
    for a CPU); nan where the job did not time its CPU."""
    rows = [c for c in clock(prefix, n) if c[1] == k]
    return sum(c[3] + c[5] for c in rows) / sum(c[4] + c[6] for c in rows) if rows else \
        float("nan")


def summary(errs: list[float], by: dict[str, list[float]]) -> None:
    if not errs:
        return
    e = np.abs(errs)
    print(f"\n{len(errs)} predictions: median |error| {np.median(e):.1%}, at most "
          f"{e.max():.1%}; within 10 %: {int((e <= 0.10).sum())}")
    for k, v in by.items():     # what pp_whatif.BAND holds, over this and earlier runs
        if v:
            print(f"{k}: {len(v)} predictions, {min(v):+.1%} .. {max(v):+.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    ap.add_argument("--pairs", default="4:8,8:4,8:16,16:8")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--reuse", type=Path)
    ap.add_argument("--probe", action="store_true",
                    help="record with --pp-probe: the one-run what-if takes each stage's "
                    "compute at the other size from the job's probe (the proportional one "
                    "beside it)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model, GPipe at 2 predicting 4 microbatches, probed: that "
                    "the bench runs")
    a = ap.parse_args()
    if a.tiny:
        a.schedules, a.pairs, a.iterations, a.width, a.batch, a.blocks, a.probe = \
            "gpipe", "2:4", 5, 128, 32, 1, True
    out = a.reuse or a.keep or Path(tempfile.mkdtemp(prefix="whatif-pp-inside-"))
    out.mkdir(parents=True, exist_ok=True)
    # the recording's shape travels with its traces: --reuse takes it from there (blocks of
    # another length than recorded would be cut in the wrong places)
    shape = out / "shape.json"
    keys = ("iterations", "width", "batch", "blocks")
    if a.reuse and shape.exists():
        for k, v in json.loads(shape.read_text()).items():
            setattr(a, k, v)
    elif not a.reuse:
        shape.write_text(json.dumps({k: getattr(a, k) for k in keys}))
    sys.path.insert(0, str(ROOT))
    from gputrace import load
    from gputrace.analyzers import analyze
    from gputrace.analyzers.parallel.pp import pp_timeline, pp_whatif

    print(f"machine: {machine()}")
    print(f"pp_train.py: {a.blocks} blocks per stage, width {a.width}, batch {a.batch}, "
          f"{a.iterations} iterations per block")
    print("| schedule | from | to | window t_iter (job) | predicted | measured | error | "
          "first block again (drift) | compute wall / CPU: window, target |")
    print("|---|---|---|---|---|---|---|---|---|")
    errs: list[float] = []
    by: dict[str, list[float]] = {"to fewer microbatches": [], "to more microbatches": []}
    runs: dict[tuple[str, int, int], tuple[Path, float, Any]] = {}
    for sched in a.schedules.split(","):
        for pair in a.pairs.split(","):
            x, y = (int(v) for v in pair.split(":"))
            prefix = out / f"{sched}_{x}_{y}"
            if not a.reuse:
                record(prefix, sched, x, y, a)
            first, then, again = blocks(prefix, a.iterations)
            pl = analyze(load(f"{prefix}.arrow"), skip=0).main.parallel.get("pp")
            if pl is None:
                print(f"| {sched} | {x} | {y} | no pipeline in the window |")
                continue
            runs[(sched, x, y)] = (prefix, then, pl)
            pred = pp_whatif.predict(pl, CLASS[sched], y).t_iter
            err = pred / then - 1
            errs.append(err)
            side = ""
            if pl.compute.probed:   # the proportional what-if beside the probed one
                plain = pp_whatif.calibrated(pl, None, pp_timeline.first_replica_of(pl.stages))
                p0 = pp_whatif.predict(plain, CLASS[sched], y).t_iter
                side = f" (proportional {p0 * 1e3:.0f} ms, {p0 / then - 1:+.1%})"
                by.setdefault("probed", []).append(err)
                by.setdefault("proportional", []).append(p0 / then - 1)
            else:
                by["to fewer microbatches" if y < x else "to more microbatches"].append(err)
            print(f"| {sched} | {x} | {y} | {first * 1e3:.0f} ms | {pred * 1e3:.0f} ms{side} | "
                  f"{then * 1e3:.0f} ms | {err:+.1%} | {again * 1e3:.0f} ms "
                  f"({again / first - 1:+.1%}) | {slowdown(prefix, a.iterations, 0):.2f}, "
                  f"{slowdown(prefix, a.iterations, 1):.2f} |", flush=True)
    summary(errs, by)
    print("\nFitted (`--calibrate` with the window of the recording at C microbatches):\n")
    print("| schedule | from | calibrated with | to | predicted | measured | error | "
          "compute wall / CPU: window, calibrating, target |")
    print("|---|---|---|---|---|---|---|---|")
    fitted: list[float] = []
    for (sched, x, y), (prefix, then, _) in runs.items():
        cal = next(((q, pl) for (s, z, _), (q, _, pl) in runs.items()
                    if s == sched and z not in (x, y)), None)
        if cal is None:
            continue
        where, other = cal
        pl = analyze(load(f"{prefix}.arrow"), skip=0,
                     calibration=pp_whatif.calibration_of(other)).main.parallel["pp"]
        if not pl.compute.calibrated_with:
            print(f"| {sched} | {x} | {other.microbatches} | {y} | not used: "
                  f"{pl.calibration_note} |")
            continue
        pred = pp_whatif.predict(pl, CLASS[sched], y).t_iter
        fitted.append(pred / then - 1)
        print(f"| {sched} | {x} | {other.microbatches} | {y} | {pred * 1e3:.0f} ms | "
              f"{then * 1e3:.0f} ms | {fitted[-1]:+.1%} | "
              f"{slowdown(prefix, a.iterations, 0):.2f}, "
              f"{slowdown(where, a.iterations, 0):.2f}, "
              f"{slowdown(prefix, a.iterations, 1):.2f} |", flush=True)
    summary(fitted, {"fitted": fitted})
    print("\nA chunk's compute on the job's own clock, per microbatch (medians, ms):\n")
    print("| schedule | recording | rank | block | m | rows | forward | forward CPU | "
          "autograd | autograd CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (sched, x, y), (prefix, _, _) in runs.items():
        for r, k, m, fw, fc, bw, bc in clock(prefix, a.iterations):
            print(f"| {sched} | {x}:{y} | {r} | {k} | {m} | {a.batch // m} | {fw * 1e3:.2f} | "
                  f"{fc * 1e3:.2f} | {bw * 1e3:.2f} | {bc * 1e3:.2f} |")


if __name__ == "__main__":
    main()
