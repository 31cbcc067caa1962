"""`gputrace export TRACE --format perfetto|chrome`: a timeline for Perfetto / chrome://tracing."""

from __future__ import annotations

import argparse

from gputrace.cli import CommandError, output_name

HELP = "export a trace as a Perfetto (protobuf) or Chrome Trace Event (JSON) timeline"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="+", help="trace file(s), shards, or another tool's trace")
    p.add_argument("--format", choices=("perfetto", "chrome"),
                   help="default: chrome where the output's name ends in .json, else perfetto")
    p.add_argument("-o", "--output", help="file to write (default: the first trace's name "
                   "without .arrow/.json/.json.gz/.sqlite, plus .pftrace for perfetto or "
                   ".trace.json for chrome: run.arrow -> run.pftrace, run.trace.json)")


def run(args: argparse.Namespace) -> int:
    from gputrace.cli import load_trace
    from gputrace.fmt import count
    from gputrace.report import export

    trace = load_trace(args.trace)
    # a file named .json holds JSON: the Trace Event format, not Perfetto's protobuf
    fmt = args.format or ("chrome" if (args.output or "").lower().endswith(".json")
                          else "perfetto")
    out = args.output or output_name(args.trace[0], ".pftrace" if fmt == "perfetto"
                                     else ".trace.json")
    try:
        n = export.write(trace, out, fmt)
    except export.ExportUnavailable as e:
        raise CommandError(str(e)) from None
    except OSError as e:
        raise CommandError(f"cannot write {out}: {e}") from None
    print(f"{out}: {count(n['slices'], 'slice')} on {count(n['tracks'], 'track')}, "
          f"{count(n['counters'], 'counter value')}; open it at https://ui.perfetto.dev")
    return 0

