"""`gputrace capture [PID | --all] [--steps N]`: open a recording window in a job running
under `gputrace record --on-demand` (or `--steps`, `--delay`), from another shell; first,
the collectives a process of it has waited in too long so far (a hang), with the ranks that
have not arrived."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Any

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
    from gputrace.recorder import capture

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
        results = []
        for j in jobs:   # what it waits in now, read before the window is asked for
            found = hangs(j)
            if not args.json:
                for h in found["collectives"]:
                    print(f"hang (over {found['threshold_s']:g} s in a collective): "
                          f"{h['message']}", flush=True)
            results.append({**capture.request(j, args.steps), "hangs": found})
    except capture.CaptureError as e:
        raise CommandError(f"gputrace capture: {e}") from None
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            print(capture.describe(r))
    return 0


def hangs(job: dict[str, Any]) -> dict[str, Any]:
    """The collectives some process of `job` has waited in too long, from what its shards
    hold so far (analyzers.extras.hangs; none where they cannot be read)."""
    from gputrace.analyzers.extras import hangs as hg
    from gputrace.trace.reader import SHARD_SUFFIXES, _read_one
    from gputrace.trace.schema import TraceFormatError

    d = job["shard_dir"]
    rows = []
    with contextlib.suppress(OSError):
        for n in sorted(os.listdir(d)):
            if n.endswith(SHARD_SUFFIXES):   # only the columns read: a shard in full can be GBs
                with contextlib.suppress(TraceFormatError, OSError, ValueError):
                    rows += hg.rows_of(_read_one(os.path.join(d, n), hg.COLUMNS).table)
    return hg.as_json(hg.find(rows))
