"""The pipeline what-if checked against the runs it predicts.

Real 2-rank pipelines over gloo on the CPU (tests/jobs/pp_train.py under torchrun:
torch.distributed.pipelining, one stage per rank, or two under `interleaved`, `izb` and `zbv`,
four under `interleaved4`) are
recorded with gputrace, one run per configuration (GPipe and 1F1B, 4 and 8 microbatches by
default; one model and global batch).
Each run predicts every other run of the round with the pipeline replay
(`gputrace.analyzers.parallel.pp.pp.predict`, what `analyze`'s `parallelism.pipeline.what_if`
is made of), and the predicted t_iter and bubble are printed beside the measured ones.

Beside each prediction, the ratio of the two runs' compute per iteration (every stage's
forward and backward of every microbatch), which the model takes to be the same at any
microbatch count and schedule: far from 1, either the machine ran the two runs at two
speeds (a shared machine) or the microbatch's compute is not proportional to its size
(fixed costs per microbatch: a small model), and the error says so, not the schedule. And
the CPU other processes used while each run recorded (the machine's busy time less this
benchmark's children's, in cores); with --quiet, each recording waits (up to that many
seconds) for the machine to be idle first.

And the same prediction replayed with the target run's own per-microbatch compute (the
source's fitted transfer, schedule work and time outside the step kept): what is left of
the error when the compute is right, i.e. the schedule replay and the transfer model alone.

And, where runs at other microbatch counts were recorded to calibrate with (--calibrate-with,
never the target itself), the prediction with the source's compute fitted as fixed +
per-sample from the source and a calibrating run of its schedule (`analyze --calibrate`):
the one whose count has the target's between it and the source's where there is one; and,
where two or more such runs were recorded, fitted through all of them (`--calibrate A,B`:
the two counts nearest the target's).

    python bench/whatif_pp.py [--configs gpipe:4,gpipe:8,1f1b:4,1f1b:8]
        [--calibrate-with gpipe:2,gpipe:16,1f1b:2,1f1b:16] [--iterations 12]
        [--width 1024] [--batch 512] [--blocks 4] [--rounds 1] [--quiet SECONDS]
        [--keep DIR | --reuse DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import PY, ROOT, machine, table

JOB = ROOT / "tests" / "jobs" / "pp_train.py"
# a pair whose compute per iteration differs by more than this did not keep the model's
# assumption (the machine's speed or the microbatch's fixed costs): the target is 10 %
SAME_COMPUTE = 0.10
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
             "izb": "ScheduleInterleavedZeroBubble",
             # Interleaved1F1B at 4 stages a rank (the what-if analyze gives an interleaved
             # run at twice its recorded stages per rank)
             "interleaved4": "ScheduleInterleaved1F1B"}
IDLE_CORES = 0.3      # --quiet: the machine counts as idle below this many cores busy
BUSY_OTHERS = 0.2     # a run beside more than this many cores of other work is marked


def _busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _children_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(limit_s: float) -> float:
    """Wait (at most limit_s) until the machine is idle over 3 s; the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        b = _busy_s()
        time.sleep(3)
        if (_busy_s() - b) / 3 < IDLE_CORES:
            break
    return time.monotonic() - t0


def configs(text: str) -> list[tuple[str, int]]:
    out = []
    for c in text.split(","):
        sched, _, m = c.partition(":")
        if sched not in SCHEDULES or not m.isdigit():
            raise SystemExit(f"--configs: {c!r} is not SCHEDULE:MICROBATCHES "
                             f"(schedules {', '.join(SCHEDULES)})")
        out.append((sched, int(m)))
    return out


def per_stage(blocks: int, sched: str) -> int:
    """A stage's blocks: `--blocks` per rank, split over the schedule's stages per rank, so
    that every configuration trains the same model (pp_train's `--blocks` is per stage: an
    interleaved run with as many per stage was a model twice as deep)."""
    v = 1 if sched in ("gpipe", "1f1b") else 4 if sched == "interleaved4" else 2
    if blocks % v:
        raise SystemExit(f"--blocks {blocks}: {sched} splits a rank's blocks over {v} stages")
    return blocks // v


def record(out: Path, sched: str, m: int, a: argparse.Namespace) -> tuple[Path, float]:
    """The trace, and the cores other processes kept busy while it was recorded."""
    trace = out / f"{sched}{m}.arrow"
    cmd = [PY, "-m", "gputrace", "record", "-q", "-f", "-o", str(trace),
           *(["--pp-probe"] if a.probe else []), "--", PY, "-m",
           "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB),
           str(out / f"{sched}{m}"), "--schedule", sched.removesuffix("4"),
           *(["--stages-per-rank", "4"] if sched == "interleaved4" else []),
           "--microbatches", str(m),
           "--iterations", str(a.iterations), "--blocks", str(per_stage(a.blocks, sched)),
           "--width",
           str(a.width), "--batch", str(a.batch)]
    others = run_recording(cmd, a.quiet)
    trace.with_suffix(".others").write_text(f"{others}\n")    # for --reuse
    return trace, others


def run_recording(cmd: list[str], quiet: float) -> float:
    """Run a `gputrace record` command with this tree's gputrace (in the recorder and in
    every process it bootstraps), first waiting up to `quiet` seconds for the machine to
    idle; the cores other processes kept busy while it ran."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if quiet:
        wait_quiet(quiet)
    b, c, t = _busy_s(), _children_s(), time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200, env=env)
    return max((_busy_s() - b) - (_children_s() - c), 0.0) / (time.monotonic() - t)


def kept(out: Path, sched: str, m: int) -> tuple[Path, float]:
    """A kept trace, and the cores others used while it was recorded (nan: not noted)."""
    trace = out / f"{sched}{m}.arrow"
    try:
        return trace, float(trace.with_suffix(".others").read_text())
    except (OSError, ValueError):
        return trace, float("nan")


def pipeline(trace: Path):  # noqa: ANN201 - gputrace.analyzers.parallel.pp.pp.Pipeline
    from gputrace import load
    from gputrace.analyzers import analyze

    pl = analyze(load(str(trace))).main.parallel.get("pp")
    if pl is None:
        raise SystemExit(f"{trace}: no pipeline in the analysis")
    return pl


def compute_s(pl) -> float:  # noqa: ANN001
    """Every stage's compute per iteration (its microbatches' forward, backward and loss)."""
    return sum(s.busy_s for s in pl.stages)


def fitted_cells(errs: list[float]) -> list[str]:
    """The fitted predictions' median error and range over the rounds ("" where none)."""
    if not errs:
        return ["", ""]
    return [f"{sorted(errs)[len(errs) // 2]:+.1%}", f"{min(errs):+.1%} .. {max(errs):+.1%}"]


def calibrator(src: tuple[str, int], dst: tuple[str, int], cals: dict[tuple[str, int], object]
               ) -> tuple[tuple[str, int], object] | None:
    """The run to fit src's compute with for predicting dst: of src's schedule, at another
    count than both; dst's count between it and src's where one is (an interpolation)."""
    mine = [c for c in cals if c[0] == src[0] and c[1] not in (src[1], dst[1])]
    if not mine or src[1] == dst[1]:
        return None
    between = [c for c in mine if min(src[1], c[1]) < dst[1] < max(src[1], c[1])]
    c = min(between or mine, key=lambda c: abs(c[1] - dst[1]))
    return c, cals[c]


def several(src: tuple[str, int], dst: tuple[str, int], cals: dict[tuple[str, int], object]
            ) -> tuple[list[tuple[str, int]], list[object]] | None:
    """Every run of src's schedule at another count than both, to fit src's compute with
    through the two counts nearest dst's (None with fewer than two)."""
    mine = sorted(c for c in cals if c[0] == src[0] and c[1] not in (src[1], dst[1]))
    if len(mine) < 2 or src[1] == dst[1]:
        return None
    return mine, [cals[c] for c in mine]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="gpipe:4,gpipe:8,1f1b:4,1f1b:8",
                    help="SCHEDULE:MICROBATCHES,... recorded in each round (gpipe, 1f1b)")
    ap.add_argument("--calibrate-with", default="gpipe:2,gpipe:16,1f1b:2,1f1b:16",
                    help="SCHEDULE:MICROBATCHES,... recorded in each round only to calibrate "
                    "the predictions with ('' for none)")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4,
                    help="blocks per rank (each stage of a rank holding two: half)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="recordings of every configuration, one round after the other")
    ap.add_argument("--quiet", type=float, default=0.0, metavar="SECONDS",
                    help="before each recording, wait up to SECONDS for the machine to idle")
    ap.add_argument("--probe", action="store_true",
                    help="record with --pp-probe (each stage timed at other sizes and its "
                         "backward split, at exit): the what-ifs use it")
    ap.add_argument("--keep", type=Path, help="keep the traces in DIR")
    ap.add_argument("--reuse", type=Path, help="analyze the traces kept in DIR again")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model, GPipe at 2 and 4 microbatches (8 to calibrate), 5 "
                    "iterations")
    a = ap.parse_args()
    if a.tiny:
        a.configs, a.iterations, a.width, a.batch, a.blocks = "gpipe:2,gpipe:4", 5, 64, 32, 1
        a.calibrate_with = "gpipe:8"
    cfgs = configs(a.configs)
    cal_cfgs = [c for c in configs(a.calibrate_with) if c not in cfgs] \
        if a.calibrate_with else []
    out = a.reuse or a.keep or Path(tempfile.mkdtemp(prefix="whatif-pp-"))
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))      # this tree's analysis
    from gputrace.analyzers.parallel.pp import pipesim, pp, pp_whatif

    try:
        runs: list[dict[tuple[str, int], object]] = []
        cal_runs: list[dict[tuple[str, int], object]] = []
        fitted_errors: list[float] = []
        several_errors: list[float] = []
        others: list[dict[tuple[str, int], float]] = []
        for i in range(a.rounds):
            sub = out / f"round{i}"
            sub.mkdir(exist_ok=True)
            # each round in another order: a machine that slows down during a round does
            # not always meet the same configuration last
            every = cfgs + cal_cfgs
            order = every[i % len(every):] + every[:i % len(every)]
            got = {c: kept(sub, *c) if a.reuse else record(sub, *c, a) for c in order}
            runs.append({c: pipeline(got[c][0]) for c in cfgs})
            cal_runs.append({c: pipeline(got[c][0]) for c in every})
            others.append({c: got[c][1] for c in cfgs})
        rows, errors = [], {True: [], False: []}
        replay_errors: list[float] = []
        by_pair: dict[tuple, list[tuple[float, float, float, float, float]]] = {}
        for i, rnd in enumerate(runs):
            for src, s in rnd.items():
                for dst, d in rnd.items():
                    if src == dst:
                        continue
                    w = pp.predict(s, SCHEDULES[dst[0]], dst[1], v=d.stages_per_rank)
                    meas = d.stages[0].t_iter
                    ratio = compute_s(d) / compute_s(s)
                    busy = max(others[i][src], others[i][dst])
                    same = abs(ratio - 1) <= SAME_COMPUTE and not busy > BUSY_OTHERS
                    err = w.t_iter / meas - 1
                    # the target's own compute, where its stages are the source's
                    own = pp.predict(s, SCHEDULES[dst[0]], dst[1], list(d.per_stage[0]),
                                     list(d.per_stage[1]), v=d.stages_per_rank) \
                        if d.num_stages == s.num_stages else w
                    cal = calibrator(src, dst, cal_runs[i])
                    fit, fe = "", 0.0
                    if cal is not None:
                        fs = pp_whatif.calibrated(s, pp_whatif.calibration_of(cal[1]),
                                                  pp.first_replica(s))
                        fe = pp_whatif.predict(fs, SCHEDULES[dst[0]], dst[1],
                                               v=d.stages_per_rank).t_iter / meas - 1
                        fitted_errors.append(fe)
                        fit = f"{fe:+.1%} ({cal[0][0]} {cal[0][1]})"
                    more = several(src, dst, cal_runs[i])
                    fit_all = ""
                    if more is not None:
                        fs = pp_whatif.calibrated(
                            s, [pp_whatif.calibration_of(x) for x in more[1]],
                            pp.first_replica(s))
                        fa = pp_whatif.predict(fs, SCHEDULES[dst[0]], dst[1],
                                               v=d.stages_per_rank).t_iter / meas - 1
                        several_errors.append(fa)
                        fit_all = f"{fa:+.1%} ({', '.join(str(c[1]) for c in more[0])})"
                    errors[same].append(err)
                    if d.num_stages == s.num_stages:
                        replay_errors.append(own.t_iter / meas - 1)
                    if not busy > BUSY_OTHERS:
                        by_pair.setdefault((src, dst), []).append(
                            (err, own.t_iter / meas - 1, ratio, w.bubble, d.bubble,
                             fe if cal is not None else None))
                    rows.append([str(i), f"{src[0]} {src[1]}", f"{dst[0]} {dst[1]}",
                                 f"{s.stages[0].t_iter * 1e3:.0f}", f"{w.t_iter * 1e3:.0f}",
                                 f"{meas * 1e3:.0f}", f"{err:+.1%}",
                                 f"{own.t_iter / meas - 1:+.1%}"
                                 if d.num_stages == s.num_stages else "", fit, fit_all,
                                 f"{w.bubble:.1%}", f"{d.bubble:.1%}",
                                 f"{pipesim.theory(d.ranks or d.num_stages, dst[1], d.stages_per_rank):.0%}",
                                 f"{ratio:.2f}" + ("" if abs(ratio - 1) <= SAME_COMPUTE
                                                   else " (differs)"),
                                 f"{busy:.2f}" if busy == busy else "?"])
        print(f"machine: {machine()}")
        print(f"pp_train.py: {a.blocks} blocks per rank, width {a.width}, batch {a.batch}, "
              f"{a.iterations} iterations; t_iter and bubble: stage 0's (its iteration is "
              "what the replay predicts), bubble: share of the iteration, mean over stages")
        print(table("Pipeline what-if against the run it predicts (one round: every "
                    "configuration recorded once, one after the other)",
                    ["round", "from", "to", "from t_iter ms", "predicted ms", "measured ms",
                     "error", "with its compute", "fitted (with)", "fitted, several (at)",
                     "bubble pred.", "bubble meas.", "theory",
                     "compute ratio",
                     "others' cores"],
                    rows))
        if len(runs) > 1 and by_pair:
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            print(table(f"By pair over the rounds whose two runs had at most {BUSY_OTHERS} "
                        "cores of other work beside them (medians; the error's range)",
                        ["from", "to", "rounds", "error", "range", "with its compute",
                         "fitted", "fitted range", "compute ratio", "bubble pred.",
                         "bubble meas."],
                        [[f"{s_[0]} {s_[1]}", f"{d_[0]} {d_[1]}", str(len(v)),
                          f"{med([x[0] for x in v]):+.1%}",
                          f"{min(x[0] for x in v):+.1%} .. {max(x[0] for x in v):+.1%}",
                          f"{med([x[1] for x in v]):+.1%}",
                          *fitted_cells([x[5] for x in v if x[5] is not None]),
                          f"{med([x[2] for x in v]):.2f}",
                          f"{med([x[3] for x in v]):.1%}", f"{med([x[4] for x in v]):.1%}"]
                         for (s_, d_), v in by_pair.items()]))
        for r, rnd in enumerate(runs):
            print(f"round {r}: fitted transfer per send/recv "
                  + ", ".join(f"{c[0]} {c[1]} {pl.transfer_s * 1e3:.1f} ms"
                              for c, pl in rnd.items()))
        for same, word in ((True, f"whose compute agrees within {SAME_COMPUTE:.0%}, beside "
                                  f"at most {BUSY_OTHERS} cores of other work"),
                           (False, "the others")):
            e = errors[same]
            if e:
                print(f"pairs {word}: {len(e)} predictions, "
                      f"|error| at most {max(abs(x) for x in e):.1%}, median "
                      f"{sorted(abs(x) for x in e)[len(e) // 2]:.1%}, mean "
                      f"{sum(e) / len(e):+.1%}")
        e = fitted_errors
        if e:
            print(f"fitted with a calibrating run: {len(e)} predictions, |error| at most "
                  f"{max(abs(x) for x in e):.1%}, median "
                  f"{sorted(abs(x) for x in e)[len(e) // 2]:.1%}, mean {sum(e) / len(e):+.1%}")
        e = several_errors
        if e:
            print(f"fitted with several calibrating runs: {len(e)} predictions, |error| at "
                  f"most {max(abs(x) for x in e):.1%}, median "
                  f"{sorted(abs(x) for x in e)[len(e) // 2]:.1%}, mean {sum(e) / len(e):+.1%}")
        e = replay_errors
        if e:
            print(f"replayed with the target's own compute: {len(e)} predictions, |error| at "
                  f"most {max(abs(x) for x in e):.1%}, median "
                  f"{sorted(abs(x) for x in e)[len(e) // 2]:.1%}, mean {sum(e) / len(e):+.1%}")
    finally:
        if a.keep is None and a.reuse is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
