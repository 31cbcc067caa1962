"""`gputrace info TRACE...`: format version, metadata, collectors, rows, time span, ranks."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "show a trace's metadata, collectors and row counts"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="+", help="trace file(s) or a directory of shards")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from gputrace.cli import load_trace
    from gputrace.report.info import render_info, trace_info

    info = trace_info(load_trace(args.trace))
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        render_info(info)
    return 0
