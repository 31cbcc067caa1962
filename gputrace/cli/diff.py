"""`gputrace diff BEFORE AFTER` (or `BEFORE... -- AFTER...`, several runs a side): did a change
help, and where, beside the run-to-run noise."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from gputrace.analysis.run import DIFF_FORMAT as FORMAT
from gputrace.analysis.run import DIFF_VERSION as VERSION
from gputrace.cli import CommandError
from gputrace.cli.options import add_options, options_of

HELP = "compare two runs: what changed, where, and whether beyond the noise"

__all__ = ["FORMAT", "HELP", "VERSION", "prepare_parser", "run", "slower_beyond"]


SEP = "\0--"      # the runs' `--`, kept through the second reading of the command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CommandError(f"gputrace diff: {message}")


def prepare_parser(p: argparse.ArgumentParser, runs: bool = True) -> None:
    what = ("a trace, a directory of shards, a multi-node recording's name or a glob "
            "(quoted), Kineto JSON or Nsight Systems SQLite")
    if runs:    # as given, `--` and the options after the runs included (read in run())
        p.add_argument("runs", nargs=argparse.REMAINDER, metavar="BEFORE... [--] AFTER...",
                       help=f"the run before the change and the run after it ({what}); or "
                       "several runs of each side, `--` between them (A1 A2 A3 -- B1 B2 "
                       "B3), or a glob a side whose files are runs recorded one after the "
                       "other ('base-*.arrow' 'new-*.arrow', as `record --repeat` names "
                       "them): the intervals then hold the drift between runs")
    else:
        p.add_argument("inputs", nargs="*")
    add_options(p, inputs=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--fail-if-slower", type=float, metavar="PCT",
                   help="exit 1 when the iteration got slower by more than PCT %% beyond "
                   "the noise (the interval's lower bound above PCT %%; with several runs a "
                   "side, the interval across them)")
    p.add_argument("--report", metavar="PATH", help="also write the diff's HTML page there "
                   "(as `gputrace report BEFORE AFTER --diff`)")


def sides(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The runs before and after, from the command line as given (`args.runs`); options
    written after the runs are read here into `args`."""
    tokens = list(args.runs)
    if "-h" in tokens or "--help" in tokens:    # after the runs: argparse left it in them
        from gputrace.cli import build_parser

        build_parser().parse_args(["diff", "--help"])     # prints the help, exits 0
    if "--" in tokens:
        tokens[tokens.index("--")] = SEP
    q = _Parser(prog="gputrace diff", add_help=False)
    prepare_parser(q, runs=False)
    rest = q.parse_args(tokens)
    for k, v in vars(rest).items():
        if k != "inputs" and v != q.get_default(k):
            setattr(args, k, v)
    inputs = rest.inputs
    if SEP in inputs:
        i = inputs.index(SEP)
        before, after = inputs[:i], inputs[i + 1:]
        if not before or not after:
            raise CommandError("gputrace diff: a run on each side of `--` (A1 A2 -- B1 B2)")
        return before, after
    if len(inputs) != 2:
        raise CommandError(f"gputrace diff: two runs, BEFORE and AFTER, not {len(inputs)}; "
                           "several runs a side go with `--` between them (A1 A2 A3 -- B1 B2 "
                           "B3)")
    return [inputs[0]], [inputs[1]]


def run(args: argparse.Namespace) -> int:
    before, after = sides(args)
    pct = args.fail_if_slower
    if pct is not None and not (math.isfinite(pct) and pct >= 0):
        raise CommandError(f"--fail-if-slower takes a percentage, 0 or more, not {pct}")
    from gputrace.cli.pages import check_output, write_diff

    if args.report:
        check_output(args.report)
    from gputrace import progress
    from gputrace.analysis.run import run_diff

    opts = options_of(args)
    with progress.shown(not args.json):
        c = run_diff(opts, before, after)
    doc = c.doc
    if args.json:
        from gputrace.report.json_text import dumps

        sys.stdout.write(dumps(doc) + "\n")
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
