"""Command line: `gputrace <command>`; one module per subcommand, each a page."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Protocol

from gputrace.fmt import reason


class CommandError(Exception):
    """A user-facing failure: one line, and the exit code (2 for bad input)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1024, "mi": 1024**2,
          "gi": 1024**3, "ti": 1024**4}


def parse_bytes(text: str, what: str, per_second: bool = False) -> float:
    """'64MiB', '1GB', '7GB/s', '56Gb/s' (small b: bits), '12.5e9' -> bytes (per second)."""
    rate = r"(?:/s|ps)?" if per_second else ""
    m = re.fullmatch(rf"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?([bB])?{rate}\s*", text,
                     re.IGNORECASE)
    if not m:
        example = "7GB/s or 56Gb/s" if per_second else "64MiB or 1GB"
        raise CommandError(f"cannot read {what} {text!r}; write e.g. {example}")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if m.group(3) == "b":  # bits
        value /= 8
    if not 0 < value < math.inf:
        raise CommandError(f"{what} must be positive and finite, not {text!r}")
    return value


def output_name(src: str, suffix: str) -> str:
    """A derived file's default name: the input's, its trace extension replaced."""
    base = src.rstrip("/")
    for ext in (".arrow", ".json.gz", ".json", ".sqlite"):
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    return base + suffix


class Command(Protocol):
    HELP: str

    def prepare_parser(self, p: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _commands() -> dict[str, Command]:
    from gputrace.cli import (
        analyze,
        capture,
        diff,
        export,
        imports,
        info,
        probe,
        record,
        recover,
        report,
    )

    return {"record": record, "capture": capture,  # type: ignore[dict-item]
            "analyze": analyze, "diff": diff, "info": info,
            "import": imports, "export": export, "probe": probe, "recover": recover,
            "report": report}


# each command's page of the manual (docs/ in the repository), named at the end of its --help
MANUAL = {"record": "recording.md", "capture": "recording.md", "analyze": "analysis.md",
          "diff": "diff.md", "info": "format.md", "import": "other-tools.md",
          "export": "other-tools.md", "probe": "probe.md", "recover": "format.md",
          "report": "report.md"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CommandError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gputrace", description="Where each training iteration's time goes.",
                epilog="manual: docs/index.md (each command's --help names its page)")
    from gputrace import __version__

    p.add_argument("--version", action="version", version=f"gputrace {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in _commands().items():
        sp = sub.add_parser(name, help=cmd.HELP, description=cmd.HELP,
                            epilog=f"manual: docs/{MANUAL[name]}")
        cmd.prepare_parser(sp)
        sp.set_defaults(_run=cmd.run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        p = build_parser()
        args = p.parse_args(argv)
        if not getattr(args, "_run", None):
            p.print_help()
            return 2
        return int(args._run(args))
    except CommandError as e:
        print(f"gputrace: error: {one_line(str(e))}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # `gputrace info t.arrow | head`: the reader has what it wanted
        try:
            # so that the interpreter's own flush at exit does not complain on stderr
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback on request
        if os.environ.get("GPUTRACE_DEBUG") == "1":
            raise
        print(f"gputrace: error: {one_line(reason(e))} (a bug in gputrace; GPUTRACE_DEBUG=1 "
              "shows where)", file=sys.stderr)
        return 1


def one_line(text: str) -> str:
    """A message as one line: control characters (a newline in a file name) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def load_trace(paths: Sequence[str], by_rank: bool = False,  # type: ignore[no-untyped-def]
               quiet: bool = False):
    """Load a trace for a command, turning every unreadable input into one line (exit 2).

    Kineto JSON and Nsight Systems SQLite files are imported on the fly. A glob pattern and
    the name of a multi-node recording stand for their files. With `by_rank`, intact trace
    files written one rank per batch (one, several, or a directory of them) come back as a
    RankedTrace, read one rank at a time by its consumer. `quiet`: the trace's warnings
    are not printed (a second reading of an input already warned of)."""
    import os

    import pyarrow as pa

    if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
        # malloc hands each converted column's memory back at once; arrow's own pools keep
        # it a while, which on a 1e7-event trace adds ~40% to the peak
        pa.set_memory_pool(pa.system_memory_pool())
    from gputrace.importers import ImportFailed, import_paths, is_foreign
    from gputrace.trace.ranked import open_ranked, ranked_files
    from gputrace.trace.reader import expand_names, load, unclosed
    from gputrace.trace.schema import TraceFormatError

    foreign = False
    try:
        # globs and the per-node files of a multi-node recording, as their files
        paths = expand_names(paths)
        # a trace that was never written because its recording was killed: its shards
        named = [p for p in paths if unclosed(p) is None]
        foreign = bool(named) and is_foreign(named)
        files = ranked_files(paths) if by_rank and not foreign else None
        ranked = open_ranked(files) if files else None
        if ranked is not None:
            return ranked
        trace = import_paths(list(paths)) if foreign else load(*paths)
    except ImportFailed as e:
        raise CommandError(str(e)) from None
    except TraceFormatError as e:
        raise CommandError(str(e)) from None
    except (OSError, ValueError, MemoryError) as e:
        raise CommandError(f"cannot read {' '.join(paths)}: {e}") from None
    except Exception as e:  # noqa: BLE001 - another tool's file with content not foreseen
        if not foreign:
            raise
        raise CommandError(f"cannot import {' '.join(paths)}: {reason(e)}") from None
    for w in [] if quiet else trace.warnings:
        print(f"gputrace: warning: {one_line(w)}", file=sys.stderr)
    return trace
