"""`gputrace analyze TRACE`: breakdown, overlap, model, speedup, findings."""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import Executor

from gputrace.cli import CommandError, parse_bytes

HELP = "analyze a trace: where each iteration's time goes and why"

def parse_bandwidth(text: str) -> float:
    """'7GB/s', '56Gb/s', '12.5e9' -> bytes per second."""
    return parse_bytes(text, "--link-bandwidth", per_second=True)


def parse_what_if(text: str):  # type: ignore[no-untyped-def]
    """'gpus=16,bandwidth=2x,bucket_cap_mb=5' -> a replay Scenario (gpus 0: the run's own)."""
    import math

    from gputrace.analyzers.replay import MIB, Scenario

    gpus, bw, bucket = 0, 1.0, None
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        try:
            if key == "gpus":
                gpus = int(value)
                ok = gpus >= 1
            elif key == "bandwidth":
                bw = float(value.lower().removesuffix("x"))
                ok = bw > 0
            elif key == "bucket_cap_mb":
                bucket = float(value) * MIB
                ok = bucket > 0
            elif key == "bucket":
                bucket = math.inf if value.lower() in ("one", "all") else \
                    parse_bytes(value, "--what-if bucket")
                ok = True
            else:
                raise CommandError(f"--what-if {text!r}: unknown key {key!r} (gpus, bandwidth, "
                                   "bucket_cap_mb, bucket)")
        except ValueError:
            ok = False
        if not ok:
            raise CommandError(f"--what-if {text!r}: bad value for {key}: {value!r}")
    return Scenario(gpus, bw, bucket)


def prepare_parser(p: argparse.ArgumentParser) -> None:
    add_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--report", metavar="PATH", help="also write the HTML report there "
                   "(as `gputrace report`)")


INPUT_HELP = "trace file(s), a directory of shards, Kineto JSON or Nsight Systems SQLite"


def add_options(p: argparse.ArgumentParser, inputs: bool = True) -> None:
    """The inputs and model options that `analyze`, `report` and `diff` share (`diff` names
    its two inputs itself)."""
    if inputs:
        p.add_argument("trace", nargs="+", help=INPUT_HELP)
    p.add_argument("--rank", type=int, help="show this rank (default: the slowest)")
    p.add_argument("--skip", type=int, help="warm-up iterations to leave out "
                   "(default: the first 10%% or 3)")
    p.add_argument("--gpus", default="2,4,8,16", help="GPU counts for the speedup model")
    p.add_argument("--link-bandwidth", help="link bandwidth for eq. 12, e.g. 7GB/s")
    p.add_argument("--what-if", action="append", default=[], metavar="SPEC",
                   help="a replay scenario, e.g. gpus=16,bandwidth=2x,bucket_cap_mb=5 "
                   "(keys: gpus, bandwidth, bucket_cap_mb, bucket=BYTES|one); repeatable")
    p.add_argument("--shared-io", action="store_true",
                   help="one loader feeds all GPUs of a node (t_io grows with N)")
    p.add_argument("--jobs", "-j", type=int, metavar="N",
                   help="analyze ranks in N worker processes (default: one per core, for "
                   "traces of 2e6 rows or more)")
    p.add_argument("--dask", metavar="ADDRESS", help="analyze ranks on a Dask distributed "
                   "cluster, e.g. tcp://scheduler:8786 (its workers read the trace files)")
    p.add_argument("--ray", metavar="ADDRESS", help="analyze ranks on a Ray cluster "
                   "(address, or 'auto'); its workers read the trace files")
    p.add_argument("--batch-size", type=int, metavar="N", help="samples each forward of the "
                   "model takes on a rank, where the trace does not tell (throughput)")
    p.add_argument("--tokens-per-sample", type=int, metavar="N",
                   help="tokens per sample, where the input is not token ids (throughput)")
    p.add_argument("--calibrate", metavar="OTHER", help="another run of the same pipeline "
                   "job at another microbatch count (a trace or shard directory): the "
                   "pipeline what-ifs fit each stage's compute per microbatch as fixed + "
                   "per-sample from the two runs")
    p.add_argument("--no-align", action="store_true", help="take each host's clock as "
                   "recorded (offsets are still estimated and reported)")


def run(args: argparse.Namespace) -> int:
    if args.report:
        from gputrace.cli.report import check_output

        check_output(args.report)
    from gputrace import progress

    with progress.shown(not args.json):
        a = analysis(args, detail=bool(args.report))
        w, mem = _extras(args, a)
    if args.json:
        from gputrace.report.json import to_dict

        doc = to_dict(a, args.rank)
        doc["memory"] = mem
        if w is not None:
            doc.update(w)
            if w["run"]["finding"]:
                doc["findings"].append({"id": "window_missed", "severity": "moderate",
                                        "message": w["run"]["finding"]})
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from gputrace.report.terminal import render

        render(a, args.rank)
        from gputrace.analyzers.memory import memory_line

        line = memory_line(mem, _rank(args, a))
        if line:
            print(line)
        if w is not None:
            from gputrace.report.window import render_window

            render_window(w)
    if args.report:
        from gputrace.cli.report import write

        sys.stdout.flush()
        print(write(a, args.report, args.rank, args.trace), file=sys.stderr)
    return 0


def _rank(args: argparse.Namespace, a) -> int:  # type: ignore[no-untyped-def]
    return args.rank if args.rank is not None else a.main.rank


def _extras(args: argparse.Namespace, a):  # type: ignore[no-untyped-def]
    """A windowed recording's `window` and `run` (None for another trace), and `memory`."""
    from gputrace.analyzers.memory import analyze_memory
    from gputrace.analyzers.window import analyze_window, window_of
    from gputrace.cli import load_trace

    table = load_trace(args.trace).table
    w = None
    if window_of(a.metadata) is not None:
        w = analyze_window(table, a.metadata, _rank(args, a))
    return w, analyze_memory(table, _rank(args, a))


def analysis(args: argparse.Namespace, detail: bool = False,  # type: ignore[no-untyped-def]
             use: Executor | None = None):
    """The Analysis of the command's inputs under its options (add_options), every user
    error a CommandError; `detail` keeps what the HTML report draws; `use`: an executor to
    analyze the ranks in (as --dask or --ray give one)."""
    import contextlib

    from pyarrow import ArrowInvalid

    from gputrace.analyzers import NothingToAnalyze, analyze, parallel_worth_it
    from gputrace.cli import load_trace
    from gputrace.parallel import EngineError, cores, executor
    from gputrace.trace.ranked import RankedTrace, RankUnreadable

    try:
        gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
        if not gpus or min(gpus) < 1:
            raise ValueError
    except ValueError:
        raise CommandError(f"--gpus takes positive integers like 2,4,8, not {args.gpus!r}") \
            from None
    if args.skip is not None and args.skip < 0:
        raise CommandError(f"--skip takes a number of iterations, 0 or more, not {args.skip}")
    link = parse_bandwidth(args.link_bandwidth) if args.link_bandwidth else None
    what_if = [parse_what_if(w) if isinstance(w, str) else w for w in args.what_if]
    if args.jobs is not None and args.jobs < 1:
        raise CommandError(f"--jobs takes a number of processes, 1 or more, not {args.jobs}")
    if args.dask is not None and args.ray is not None:
        raise CommandError("--dask and --ray: choose one engine")
    engine = use is not None or args.dask is not None or args.ray is not None
    batch = (getattr(args, "batch_size", None), getattr(args, "tokens_per_sample", None))
    for opt, v in zip(("--batch-size", "--tokens-per-sample"), batch, strict=True):
        if v is not None and v < 1:
            raise CommandError(f"{opt} takes a positive number, not {v}")
    cal = _calibration(args) if getattr(args, "calibrate", None) else None
    kw = dict(skip=args.skip, gpus=gpus, link_bytes_per_s=link, shared_io=args.shared_io,
              what_if=what_if, consume=True, detail=detail, align=not args.no_align,
              calibration=cal, batch=batch)
    try:
        with contextlib.ExitStack() as stack:
            # an engine is reached first: an address that does not answer fails before any
            # work is done
            ex = use if use is not None else \
                stack.enter_context(executor(1, args.dask, args.ray)) if engine else None
            trace = load_trace(args.trace, by_rank=True)
            if engine and not isinstance(trace, RankedTrace):
                print(f"gputrace: note: {' '.join(args.trace)} is not written one rank per "
                      "record batch (an import, or a recording not closed): analyzed here, "
                      "not on the cluster", file=sys.stderr)
            if not engine and parallel_worth_it(trace, args.jobs):
                ex = stack.enter_context(executor(args.jobs or cores()))
            try:
                a = analyze(trace, executor=ex if isinstance(trace, RankedTrace) else None,
                            **kw)
            except RankUnreadable:   # read it whole instead, recovering every complete batch
                trace = load_trace(args.trace)
                a = analyze(trace, **kw)
    except EngineError as e:
        raise CommandError(str(e)) from None
    except NothingToAnalyze as e:
        raise CommandError(f"{' '.join(args.trace)}: {e}") from None
    except (UnicodeDecodeError, ArrowInvalid) as e:
        raise CommandError(f"{' '.join(args.trace)}: corrupt trace ({e})") from None
    if args.rank is not None and args.rank not in a.ranks:
        raise CommandError(f"no rank {args.rank} in the trace (ranks: "
                           f"{', '.join(map(str, sorted(a.ranks)))})")
    _say_skip_clamped(a, args.skip, args.rank)
    return a


def _calibration(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--calibrate's run, analyzed under the same options: its pipeline, what this run's
    what-ifs fit their compute with."""
    from gputrace.analyzers.parallel.pp_whatif import calibration_of

    other = argparse.Namespace(**{**vars(args), "trace": [args.calibrate], "calibrate": None,
                                  "rank": None, "report": None, "skip": None})
    a = analysis(other)
    pl = next((ra.parallel["pp"] for ra in a.ranks.values() if "pp" in ra.parallel), None)
    if pl is None:
        raise CommandError(f"--calibrate {args.calibrate}: no pipeline in it (it takes a run "
                           "of the same pipeline job at another microbatch count)")
    return calibration_of(pl)


def _say_skip_clamped(a, skip: int | None, rank: int | None) -> None:  # type: ignore[no-untyped-def]
    """--skip beyond the trace's iterations leaves the last one to analyze: say so."""
    if skip is None:
        return
    ra = a.ranks[rank] if rank is not None else a.main
    if ra.warmup_skipped < skip and not ra.synthetic_iterations:
        print(f"gputrace: note: --skip {skip}: rank {ra.rank} has {ra.iterations} "
              f"iteration{'s' if ra.iterations != 1 else ''}; {ra.warmup_skipped} skipped, "
              f"the last {ra.iterations - ra.warmup_skipped} analyzed", file=sys.stderr)
