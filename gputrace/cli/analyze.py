"""`gputrace analyze TRACE`: breakdown, overlap, model, speedup, findings."""

from __future__ import annotations

import argparse
import json
import re
import sys

from gputrace.cli import CommandError

HELP = "analyze a trace: where each iteration's time goes and why"

_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1024, "mi": 1024**2,
          "gi": 1024**3, "ti": 1024**4}


def parse_bandwidth(text: str) -> float:
    """'7GB/s', '56Gb/s', '12.5e9' -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?)?([bB])?(?:/s|ps)?\s*", text,
                     re.IGNORECASE)
    if not m:
        raise CommandError(f"cannot read bandwidth {text!r}; write e.g. 7GB/s or 56Gb/s")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if m.group(3) == "b":  # bits
        value /= 8
    if value <= 0:
        raise CommandError("--link-bandwidth must be positive")
    return value


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="+", help="trace file(s), a directory of shards")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--rank", type=int, help="show this rank (default: the slowest)")
    p.add_argument("--skip", type=int, help="warm-up iterations to leave out "
                   "(default: the first 10%% or 3)")
    p.add_argument("--gpus", default="2,4,8,16", help="GPU counts for the speedup model")
    p.add_argument("--link-bandwidth", help="link bandwidth for eq. 12, e.g. 7GB/s")
    p.add_argument("--shared-io", action="store_true",
                   help="one loader feeds all GPUs of a node (t_io grows with N)")


def run(args: argparse.Namespace) -> int:
    from pyarrow import ArrowInvalid

    from gputrace.analyzers import NothingToAnalyze, analyze
    from gputrace.cli import load_trace

    try:
        gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
        if not gpus or min(gpus) < 1:
            raise ValueError
    except ValueError:
        raise CommandError(f"--gpus takes positive integers like 2,4,8, not {args.gpus!r}") \
            from None
    link = parse_bandwidth(args.link_bandwidth) if args.link_bandwidth else None
    trace = load_trace(args.trace)
    try:
        a = analyze(trace, skip=args.skip, gpus=gpus, link_bytes_per_s=link,
                    shared_io=args.shared_io)
    except NothingToAnalyze as e:
        raise CommandError(f"{' '.join(args.trace)}: {e}") from None
    except (UnicodeDecodeError, ArrowInvalid) as e:
        raise CommandError(f"{' '.join(args.trace)}: corrupt trace ({e})") from None
    if args.rank is not None and args.rank not in a.ranks:
        raise CommandError(f"no rank {args.rank} in the trace (ranks: "
                           f"{', '.join(map(str, sorted(a.ranks)))})")
    if args.json:
        from gputrace.report.json import to_dict

        json.dump(to_dict(a, args.rank), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from gputrace.report.terminal import render

        render(a, args.rank)
    return 0
