"""`gputrace diff BEFORE AFTER`: did a change help, and where, beside the run-to-run noise."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from gputrace.analysis import DIFF_FORMAT as FORMAT
from gputrace.analysis import DIFF_VERSION as VERSION
from gputrace.cli import CommandError
from gputrace.cli.options import add_options, options_of

HELP = "compare two runs: what changed, where, and whether beyond the noise"

__all__ = ["FORMAT", "HELP", "VERSION", "prepare_parser", "run", "slower_beyond"]


def prepare_parser(p: argparse.ArgumentParser) -> None:
    what = ("a trace, a directory of shards, a multi-node recording's name or a glob "
            "(quoted), Kineto JSON or Nsight Systems SQLite")
    p.add_argument("before", help=f"the run before the change: {what}")
    p.add_argument("after", help="the run after it, the same kinds of input")
    add_options(p, inputs=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--fail-if-slower", type=float, metavar="PCT",
                   help="exit 1 when the iteration got slower by more than PCT %% beyond "
                   "the noise (the interval's lower bound above PCT %%)")
    p.add_argument("--report", metavar="PATH", help="also write the diff's HTML page there "
                   "(as `gputrace report BEFORE AFTER --diff`)")


def run(args: argparse.Namespace) -> int:
    pct = args.fail_if_slower
    if pct is not None and not (math.isfinite(pct) and pct >= 0):
        raise CommandError(f"--fail-if-slower takes a percentage, 0 or more, not {pct}")
    from gputrace.cli.pages import check_output, write_diff

    if args.report:
        check_output(args.report)
    from gputrace import progress
    from gputrace.analysis import run_diff

    opts = options_of(args)
    with progress.shown(not args.json):
        c = run_diff(opts, args.before, args.after)
    doc = c.doc
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from gputrace.report.diff import render

        render(doc)
    if args.report:
        print(write_diff(c, args.report), file=sys.stderr)
    return 1 if pct is not None and slower_beyond(doc, pct) else 0


def slower_beyond(doc: dict[str, Any], pct: float) -> bool:
    """The iteration's change, at the low end of its interval, is more than `pct` % slower."""
    h = doc["headline"]
    if h["low"] is None or not h["before"]:
        return False
    return bool(h["low"] / h["before"] * 100 > pct)
