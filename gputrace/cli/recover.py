"""`gputrace recover TRACE`: finalize the shards of a recording that was killed before it
could write TRACE (kill -9, the OOM killer, a scheduler's time limit) into TRACE."""

from __future__ import annotations

import argparse
import os

from gputrace.cli import CommandError

HELP = "write the trace of a recording that was killed before it could (from its shards)"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="the trace the recording was writing (e.g. run.arrow), or "
                   "its shard directory (.run.arrow.XXXXXXXX.shards)")
    p.add_argument("-o", "--output", help="file to write (default: TRACE)")
    p.add_argument("-f", "--force", action="store_true", help="replace an existing file")


def run(args: argparse.Namespace) -> int:
    from gputrace.fmt import count
    from gputrace.record.merge import merge_shards
    from gputrace.trace import shards
    from gputrace.trace.schema import TraceFormatError

    src = args.trace.rstrip("/") or args.trace
    if os.path.isdir(src):
        name = os.path.basename(src)
        if not (name.startswith(".") and name.endswith(shards.SUFFIX)):
            raise CommandError(f"{src} is not a recording's shard directory "
                               "(.NAME.XXXXXXXX.shards)")
        directory = src
        target = os.path.join(os.path.dirname(src),
                              name[1:-len(shards.SUFFIX)].rsplit(".", 1)[0])
        others: list[str] = []
    else:
        found = shards.find(src)
        if not found:
            if os.path.exists(src):
                raise CommandError(f"{src} was closed; nothing to recover")
            raise CommandError(f"{src}: no such file, and no unfinished recording of it in "
                               f"{os.path.dirname(os.path.abspath(src))}")
        directory, others = found[0], found[1:]
        target = src
    out = args.output or target
    if os.path.isdir(out):
        raise CommandError(f"{out} is a directory; give a file name with -o")
    if os.path.exists(out) and not args.force:
        raise CommandError(f"{out} exists; use -f to replace it or -o to choose another name")
    lock = shards.take(directory)
    if lock is None:
        raise CommandError(f"{directory} is still being recorded into (a process of the run is "
                           "alive); recover it once the run has ended")
    try:
        res = merge_shards(directory, out, top={"recovered_from": os.path.abspath(directory)})
    except TraceFormatError as e:
        raise CommandError(f"nothing to recover: {e}") from None
    except OSError as e:
        raise CommandError(f"cannot write {out}: {e}; the shards stay in {directory}") from None
    finally:
        os.close(lock)
    cut = len(res.warnings)
    print(f"{out}: {count(res.rows, 'row')} from {count(res.shards, 'shard')}"
          + (f" ({cut} cut short, recovered to their last complete batch)" if cut else "")
          + "; the recording was not closed, so it has no exit code")
    from gputrace.recorder.ring import dropped_line

    line = dropped_line(res.path)
    if line:
        print(line)
    for d in others:
        print(f"an older unfinished recording of {target} remains: {d}")
    return 0
