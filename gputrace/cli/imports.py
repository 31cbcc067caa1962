"""`gputrace import FILE...`: Kineto JSON / Nsight Systems SQLite -> a gputrace trace."""

from __future__ import annotations

import argparse
import os

from gputrace.cli import CommandError

HELP = "convert PyTorch profiler (Kineto) JSON or Nsight Systems SQLite traces"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="Kineto .json/.json.gz (one per rank, or a "
                   "directory of them) and/or nsys .sqlite exports")
    p.add_argument("-o", "--output", default="imported.arrow", help="trace to write "
                   "(default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from gputrace.cli import load_trace
    from gputrace.fmt import count
    from gputrace.importers import ImportFailed, is_foreign
    from gputrace.trace.writer import write_by_rank

    try:
        if not is_foreign(args.files):
            raise CommandError(f"{' '.join(args.files)}: already gputrace traces")
    except ImportFailed as e:
        raise CommandError(str(e)) from None
    from gputrace import progress

    tmp = f"{args.output}.tmp{os.getpid()}"
    try:
        with progress.shown():
            trace = load_trace(args.files)
            progress.update(f"writing {args.output}", 0, None)
            write_by_rank(tmp, trace.metadata, trace.table)
        os.replace(tmp, args.output)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise CommandError(f"cannot write {args.output}: {e}") from None
    ranks = trace.metadata.get("ranks") or []
    print(f"{args.output}: {count(trace.num_rows, 'event')}, ranks {', '.join(map(str, ranks)) or '-'}")
    return 0
