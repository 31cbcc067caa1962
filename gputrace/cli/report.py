"""`gputrace report TRACE... -o report.html`: the analysis as one self-contained HTML page."""

from __future__ import annotations

import argparse

from gputrace.cli import CommandError, output_name
from gputrace.cli.options import add_options, options_of
from gputrace.cli.pages import check_output, write, write_diff

HELP = "write an HTML page of charts (breakdown, timeline, ranks, bandwidth, speedup, what-if)"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    add_options(p)
    p.add_argument("-o", "--output", help="page to write (default: TRACE.html; with --diff: "
                   "AFTER-diff.html)")
    p.add_argument("--diff", action="store_true", help="the page of `gputrace diff BEFORE "
                   "AFTER`: give the two runs as the inputs")


def run(args: argparse.Namespace) -> int:
    if args.diff:
        return run_diff(args)
    out = args.output or output_name(args.trace[0], ".html")
    check_output(out)
    from gputrace import progress
    from gputrace.analysis.run import run_analysis

    opts = options_of(args)
    with progress.shown():
        a = run_analysis(opts, detail=True)
        progress.update("writing the report", 0, None)
        line = write(a, out, args.rank, args.trace)
    print(line)
    return 0


def run_diff(args: argparse.Namespace) -> int:
    """`report BEFORE AFTER --diff`: the diff's page."""
    if len(args.trace) != 2:
        raise CommandError(f"--diff compares two runs: give BEFORE and AFTER, not "
                           f"{len(args.trace)} input{'s' if len(args.trace) != 1 else ''}")
    out = args.output or output_name(args.trace[1], "-diff.html")
    check_output(out)
    from gputrace import progress
    from gputrace.analysis.run import run_diff as diff_of

    opts = options_of(args)
    with progress.shown():
        c = diff_of(opts, args.trace[0], args.trace[1])
        progress.update("writing the report", 0, None)
        line = write_diff(c, out)
    print(line)
    return 0
