"""`gputrace analyze TRACE`: breakdown, overlap, model, speedup, findings."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

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
    from gputrace.analysis import run_analysis

    opts = options_of(args)
    with progress.shown(not args.json):
        a = run_analysis(opts, detail=bool(args.report))
        w = _window(args, a)
    if args.json:
        from gputrace.report.json import to_dict

        doc = to_dict(a, args.rank)
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
        if w is not None:
            from gputrace.report.window import render_window

            render_window(w)
    if args.report:
        sys.stdout.flush()
        print(write(a, args.report, args.rank, args.trace), file=sys.stderr)
    return 0


def _window(args: argparse.Namespace, a: Any) -> Any:
    """A windowed recording's `window` and `run` (None for another trace)."""
    from gputrace.analyzers.window import analyze_window, window_of

    if window_of(a.metadata) is None:
        return None
    from gputrace.cli import load_trace

    rank = args.rank if args.rank is not None else a.main.rank
    return analyze_window(load_trace(args.trace).table, a.metadata, rank)
