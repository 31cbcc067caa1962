"""Command line: `gputrace <command>`; one module per subcommand, each a page."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from typing import Protocol

from gputrace.analysis import nopandas
from gputrace.analysis.inputs import AnalysisError, one_line
from gputrace.analysis.inputs import load_inputs as load_trace
from gputrace.analysis.run import parse_bytes
from gputrace.fmt import reason

__all__ = ["CommandError", "entry", "load_trace", "main", "one_line", "output_name",
           "parse_bytes"]


class CommandError(Exception):
    """A user-facing failure: one line, and the exit code (2 for bad input)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


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
        docs,
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
            "report": report, "docs": docs}


# each command's page of the manual (docs/ in the repository, shipped in the package: `gputrace
# docs PAGE`), named at the end of its --help
MANUAL = {"record": "recording.md", "capture": "recording.md", "analyze": "analysis.md",
          "diff": "diff.md", "info": "format.md", "import": "other-tools.md",
          "export": "other-tools.md", "probe": "probe.md", "recover": "format.md",
          "report": "report.md", "docs": "index.md"}


def _manual(page: str) -> str:
    return f"manual: gputrace docs {page.removesuffix('.md')} (docs/{page})"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CommandError(f"{self.prog}: {message}")


@functools.cache
def build_parser() -> argparse.ArgumentParser:
    """Built once per process (parsing leaves it as it was; `append` copies its default)."""
    p = _Parser(prog="gputrace", description="Where each training iteration's time goes.",
                epilog="manual: gputrace docs index (docs/index.md; `gputrace docs` lists the "
                       "pages)")
    from gputrace import __version__

    p.add_argument("--version", action="version", version=f"gputrace {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in _commands().items():
        sp = sub.add_parser(name, help=cmd.HELP, description=cmd.HELP,
                            epilog=_manual(MANUAL[name]))
        cmd.prepare_parser(sp)
        sp.set_defaults(_run=cmd.run)
    return p


def entry() -> int:
    """The `gputrace` command's process: `main` without pandas (analysis.nopandas). Not
    for `main` called inside another program."""
    nopandas.block()
    return main(sys.argv[1:])


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
    except AnalysisError as e:
        print(f"gputrace: error: {one_line(str(e))}", file=sys.stderr)
        return 2
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
