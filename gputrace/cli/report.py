"""`gputrace report TRACE... -o report.html`: the analysis as one self-contained HTML page."""

from __future__ import annotations

import argparse
import os

from gputrace.cli import CommandError, output_name
from gputrace.cli.analyze import add_options, analysis

HELP = "write an HTML page of charts (breakdown, timeline, ranks, bandwidth, speedup, what-if)"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    add_options(p)
    p.add_argument("-o", "--output", help="page to write (default: TRACE.html)")


def run(args: argparse.Namespace) -> int:
    out = args.output or output_name(args.trace[0], ".html")
    check_output(out)
    from gputrace import progress

    with progress.shown():
        a = analysis(args, detail=True)
        progress.update("writing the report", 0, None)
        line = write(a, out, args.rank, args.trace)
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
