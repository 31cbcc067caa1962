"""`gputrace analyze TRACE`: breakdown, overlap, model, speedup, findings."""

from __future__ import annotations

import argparse

from gputrace.cli import CommandError

HELP = "analyze a trace: where each iteration's time goes and why"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="+")


def run(args: argparse.Namespace) -> int:
    raise CommandError("analyze is not available yet")
