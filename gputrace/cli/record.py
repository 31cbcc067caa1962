"""`gputrace record [-o PATH] [--hz N] [--collectors LIST] [-f] -- CMD ...`"""

from __future__ import annotations

import argparse

from gputrace.cli import CommandError
from gputrace.collectors import ALL_COLLECTORS

HELP = "run a command (python, torchrun, mpirun, ...) and record a trace of it"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", default="trace.arrow", help="trace file (trace.arrow)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite an existing trace")
    p.add_argument("--hz", type=float, default=50.0, help="system sampling rate (50)")
    p.add_argument("--collectors", default=",".join(ALL_COLLECTORS),
                   help=f"comma-separated subset of {','.join(ALL_COLLECTORS)}")
    p.add_argument("--gpu-timeline", choices=("auto", "cupti", "kineto"), default="auto",
                   help="where GPU kernels and copies come from: CUPTI (cupti-python), "
                   "torch.profiler's Kineto, or auto: CUPTI, else Kineto when torch has CUDA")
    p.add_argument("--tf-steps", metavar="START:COUNT",
                   help="TensorFlow: the steps its profiler records phases over (5:10); "
                   "'all' for the whole run, 'off' for iterations only; a multi-worker job is "
                   "profiled only when asked")
    p.add_argument("--layers", choices=("blocks", "leaves", "off"),
                   help="PyTorch modules timed per layer: blocks (default: transformer blocks, "
                   "stages), leaves (every module with parameters) or off (phases only)")
    p.add_argument("--layer-forward", action="store_true",
                   help="PyTorch: time each of those layers' forward too (a span per call; "
                   "about 1%% on a 12-block transformer); by default a layer's backward is "
                   "timed, what the analysis uses")
    p.add_argument("--flops", choices=("on", "off"), default="on",
                   help="PyTorch: count one iteration's FLOPs per layer with torch's "
                   "FlopCounterMode (on, the default; that iteration is left out of the "
                   "timings), or off")
    p.add_argument("--pp-probe", action="store_true",
                   help="PyTorch pipelines (torch.distributed.pipelining, DeepSpeed's "
                   "pipeline engine): after the last iteration, time each stage's forward "
                   "and backward at half and twice the microbatch's rows, and its backward "
                   "split as the zero-bubble schedules split it (inside the job, on its own "
                   "inputs; nothing of the job changes), so that the microbatch and schedule "
                   "what-ifs take how its compute changes from this run")
    p.add_argument("--steps", metavar="START:COUNT",
                   help="PyTorch: record COUNT iterations from iteration START (0-based) in "
                   "full detail; every other iteration keeps its time and phase sums only")
    p.add_argument("--delay", type=float, metavar="S",
                   help="PyTorch: record in full detail the iterations that begin S seconds "
                   "after the job starts or later (with --duration: and end within it); "
                   "the others keep their time and phase sums only")
    p.add_argument("--duration", type=float, metavar="S",
                   help="with --delay (or from the start): the window's length in seconds")
    p.add_argument("--on-demand", action="store_true",
                   help="PyTorch: record every iteration's time and phase sums only, until "
                   "`gputrace capture` (or SIGUSR2 to this process) opens a window of "
                   "iterations in full detail")
    p.add_argument("--capture-steps", type=int, default=20, metavar="N",
                   help="the iterations a window opened by SIGUSR2 holds (20); with a window "
                   "(--on-demand, --steps, --delay) SIGUSR2 opens one instead of reaching "
                   "the job")
    p.add_argument("--max-size", metavar="SIZE",
                   help="PyTorch: keep at most SIZE (e.g. 5MB) of detail on disk per process "
                   "(the system sampler's ticks too), the most recent; every iteration keeps "
                   "its time and phase sums")
    p.add_argument("--redact-argv", action="store_true",
                   help="keep only program and flag names of argv in the trace")
    p.add_argument("--kill-after", type=float, default=10.0, metavar="S",
                   help="SIGKILL the job S seconds after a forwarded signal (10)")
    p.add_argument("--per-host", action="store_true",
                   help="put this host's name in the file name (run.HOST.arrow), as is done "
                   "when the launcher says the job spans several nodes")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary")
    p.add_argument("--report", metavar="PATH",
                   help="at the end, write the HTML report of the trace there")
    p.add_argument("--repeat", type=int, metavar="N",
                   help="record the command N times, one trace each, numbered: -o base.arrow "
                   "writes base-1.arrow ... base-N.arrow (the runs `gputrace diff` compares "
                   "with the drift between them)")
    p.add_argument("--interleave", metavar="PATH",
                   help="with --repeat: a second command, after a second `--`, recorded N "
                   "times into PATH's numbered names, alternating with the first (A B, B A, "
                   "A B, ...): -o base.arrow --interleave new.arrow -- CMD_A ... -- CMD_B ... "
                   "(CMD_A holds no `--` of its own)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


def run(args: argparse.Namespace) -> int:
    from gputrace.record.runner import RecordError, RecordOptions, record

    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    second: list[str] | None = None
    if args.repeat is not None and args.repeat < 1:
        raise CommandError(f"--repeat takes a count of runs, 1 or more, not {args.repeat}")
    if args.interleave is not None:
        if args.repeat is None:
            raise CommandError("--interleave goes with --repeat N")
        if "--" not in cmd:
            raise CommandError("--interleave: the second command after a second `--` "
                               "(-- CMD_A ... -- CMD_B ...)")
        i = cmd.index("--")
        cmd, second = cmd[:i], cmd[i + 1:]
        if not cmd or not second:
            raise CommandError("--interleave: a command on each side of the second `--`")
    if args.repeat is not None and args.report:
        raise CommandError("--report records one run; with --repeat, `gputrace report` each")
    opts = RecordOptions(
        command=cmd, output=args.output, hz=args.hz,
        collectors=[c.strip() for c in args.collectors.split(",") if c.strip()],
        force=args.force, redact_argv=args.redact_argv, gpu_timeline=args.gpu_timeline,
        kill_after_s=args.kill_after, per_host=True if args.per_host else None,
        tf_steps=args.tf_steps, layers=args.layers, layer_forward=args.layer_forward, flops=args.flops,
        pp_probe=args.pp_probe,
        quiet=args.quiet, steps=args.steps, delay_s=args.delay, duration_s=args.duration,
        on_demand=args.on_demand, capture_steps=args.capture_steps,
        max_size=args.max_size)
    if args.report:
        from gputrace.cli.pages import check_output

        check_output(args.report)
    if args.repeat is not None:
        from dataclasses import replace

        from gputrace.record.repeat import repeat

        sides = [opts] + ([replace(opts, command=second, output=args.interleave)]
                          if second is not None else [])
        try:
            done = repeat(sides, args.repeat)
        except RecordError as e:
            raise CommandError(str(e)) from None
        return done[-1].exit_code
    try:
        res = record(opts)
    except RecordError as e:
        raise CommandError(str(e)) from None
    if args.report and res.output:
        import sys

        from gputrace.analysis.run import AnalysisError
        from gputrace.cli.pages import report_of

        try:   # the job's exit code stands whatever becomes of the report
            print(report_of(res.output, args.report), file=sys.stderr)
        except (CommandError, AnalysisError) as e:
            print(f"gputrace: no report: {e}", file=sys.stderr)
    return res.exit_code
