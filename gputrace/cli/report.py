"""`gputrace report TRACE... -o report.html`: the analysis as one self-contained HTML page."""

from __future__ import annotations

import argparse
import os

from gputrace.cli import CommandError, output_name
from gputrace.cli.analyze import add_options, analysis

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

    with progress.shown():
        a = analysis(args, detail=True)
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
    from gputrace.cli.diff import compared, write_page

    diff_args = argparse.Namespace(**{**vars(args), "before": args.trace[0],
                                      "after": args.trace[1]})
    with progress.shown():
        c = compared(diff_args)
        progress.update("writing the report", 0, None)
        line = write_page(c, out)
    print(line)
    return 0


def check_output(path: str) -> None:
    """Before any work: the plotting extra is there and the page can be written."""
    from gputrace.report.html import ReportUnavailable, available

    try:
        available()
    except ReportUnavailable as e:
        raise CommandError(str(e)) from None
    if os.path.isdir(path):
        raise CommandError(f"{path} is a directory; give the report a file name")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise CommandError(f"cannot write {path}: directory {d} does not exist")


def write(a, path: str, rank: int | None, traces: list[str]) -> str:  # type: ignore[no-untyped-def]
    """Write the page; the line that says where it is."""
    from gputrace.report.html import ReportUnavailable
    from gputrace.report.html import write as write_html

    try:
        n = write_html(a, path, rank, " ".join(traces))
    except OSError as e:
        raise CommandError(f"cannot write {path}: {e}") from None
    except ReportUnavailable as e:
        raise CommandError(str(e)) from None
    return f"report: {path} ({n / 1e6:.2f} MB), open it in a browser"


def report_of(trace: str, path: str) -> str:
    """The report of a trace with the default options (`record --report`)."""
    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args([trace])
    return write(analysis(args, detail=True), path, None, [trace])
