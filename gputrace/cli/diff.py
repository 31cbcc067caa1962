"""`gputrace diff BEFORE AFTER`: did a change help, and where, beside the run-to-run noise."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from gputrace.analyzers import Analysis
from gputrace.cli import CommandError

HELP = "compare two runs: what changed, where, and whether beyond the noise"

FORMAT = "gputrace-diff"
VERSION = 1


def prepare_parser(p: argparse.ArgumentParser) -> None:
    from gputrace.cli.analyze import add_options

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
    if args.report:
        from gputrace.cli.report import check_output

        check_output(args.report)
    from gputrace import progress

    with progress.shown(not args.json):
        c = compared(args)
    doc = c.doc
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from gputrace.report.diff import render

        render(doc)
    if args.report:
        print(write_page(c, args.report), file=sys.stderr)
    return 1 if pct is not None and slower_beyond(doc, pct) else 0


@dataclass(frozen=True)
class Compared:
    """The diff document and the two analyses it was made from (for the page's timelines)."""

    doc: dict[str, Any]
    before: Analysis
    after: Analysis


def write_page(c: Compared, path: str) -> str:
    """Write the diff's HTML page; the line that says where it is."""
    from gputrace.report.diff_html import write
    from gputrace.report.html import ReportUnavailable

    try:
        n = write(c.doc, c.before, c.after, path)
    except OSError as e:
        raise CommandError(f"cannot write {path}: {e}") from None
    except ReportUnavailable as e:
        raise CommandError(str(e)) from None
    return f"report: {path} ({n / 1e6:.2f} MB), open it in a browser"


def slower_beyond(doc: dict[str, Any], pct: float) -> bool:
    """The iteration's change, at the low end of its interval, is more than `pct` % slower."""
    h = doc["headline"]
    if h["low"] is None or not h["before"]:
        return False
    return bool(h["low"] / h["before"] * 100 > pct)


def document(args: argparse.Namespace) -> dict[str, Any]:
    """The diff document (`diff --json`) of the command's two inputs under analyze's
    options, every user error a CommandError."""
    return compared(args).doc


def compared(args: argparse.Namespace) -> Compared:
    """The diff document and both analyses (made with their detail)."""
    from gputrace.analyzers.diff import compare

    sides = [_side(args, path) for path in (args.before, args.after)]
    (ab, pb), (aa, pa) = sides
    rb = args.rank if args.rank is not None else ab.slowest_rank
    ra = args.rank if args.rank is not None else aa.slowest_rank
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION,
                           "before": args.before, "after": args.after}
    doc.update(compare(ab, aa, rb, ra, pb, pa))
    return Compared(doc, ab, aa)


def _side(args: argparse.Namespace, path: str):  # type: ignore[no-untyped-def]
    """One input's analysis (analyze's, with its detail) and its per-name parts."""
    from gputrace.analyzers.diff_parts import Parts, parts
    from gputrace.cli import load_trace
    from gputrace.cli.analyze import analysis

    one = argparse.Namespace(**{**vars(args), "trace": [path]})
    a = analysis(one, detail=True)
    ra = a.ranks[args.rank if args.rank is not None else a.slowest_rank]
    d = ra.detail
    if d is None or ra.iterations - ra.warmup_skipped < 1:
        return a, Parts()
    s = d.series
    trace = load_trace([path], quiet=True)
    table = getattr(trace, "table", None)
    if table is None:
        return a, Parts()
    return a, parts(table, ra.rank, s.start_ns[s.warmup:], int(s.end_ns[-1]))
