"""`gputrace capture [PID | --all] [--steps N]`: open a recording window in a job running
under `gputrace record --on-demand` (or `--steps`, `--delay`), from another shell."""

from __future__ import annotations

import argparse
import json

from gputrace.cli import CommandError

HELP = "open a window of N iterations in full detail in a running recording"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("pid", nargs="?", type=int,
                   help="the `gputrace record` process, or any process of the job it records")
    p.add_argument("--all", action="store_true", help="every recording running on this host")
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="iterations the window holds (20)")
    p.add_argument("--json", action="store_true", help="where each window opened, as JSON")


def run(args: argparse.Namespace) -> int:
    from gputrace import capture

    if (args.pid is None) == (not args.all):
        raise CommandError("gputrace capture: give a PID or --all, one of them")
    if args.steps < 1:
        raise CommandError(f"--steps takes a number of iterations, 1 or more, not {args.steps}")
    try:
        if args.all:
            jobs = [j for j in capture.jobs() if j.get("window")]
            if not jobs:
                raise capture.CaptureError("no recording with --on-demand, --steps or --delay "
                                           "is running on this host")
        else:
            jobs = [capture.find(args.pid)]
        results = [capture.request(j, args.steps) for j in jobs]
    except capture.CaptureError as e:
        raise CommandError(f"gputrace capture: {e}") from None
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            print(capture.describe(r))
    return 0
