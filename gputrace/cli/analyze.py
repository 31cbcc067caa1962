"""`gputrace analyze TRACE`: breakdown, overlap, model, speedup, findings."""

from __future__ import annotations

import argparse
import sys

from gputrace.cli.options import add_options, options_of

HELP = "analyze a trace: where each iteration's time goes and why"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    add_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--report", metavar="PATH", help="also write the HTML report there "
                   "(as `gputrace report`)")


def run(args: argparse.Namespace) -> int:
    from gputrace.cli.pages import check_output, write

    if args.report:
        check_output(args.report)
    from gputrace import progress
    from gputrace.analysis.extras import beside
    from gputrace.analysis.run import run_analysis
    from gputrace.report.document import document

    opts = options_of(args)
    with progress.shown(not args.json):
        a = run_analysis(opts, detail=bool(args.report))
        more = beside(a, args.rank, args.trace).doc
    if args.json:
        from gputrace.report.json_text import dumps

        sys.stdout.write(dumps(document(a, args.rank, args.trace, more)) + "\n")
    else:
        from gputrace.report.terminal_all import render_all

        render_all(a, more, args.rank)
    if args.report:
        sys.stdout.flush()
        print(write(a, args.report, args.rank, args.trace), file=sys.stderr)
    return 0

