"""`gputrace docs [PAGE]`: the manual's pages, as the installed package holds them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gputrace.cli import CommandError

HELP = "print a page of the manual (without PAGE: the list of pages)"


def manual_dir() -> Path:
    """The manual's pages: shipped in the package (gputrace/manual, put there when the wheel
    is built), else the checkout's docs/ (an editable install)."""
    here = Path(__file__).resolve().parents[1]
    shipped = here / "manual"
    return shipped if shipped.is_dir() else here.parent / "docs"


def pages() -> dict[str, Path]:
    """Each page by its name (the file's, less .md), in name order."""
    d = manual_dir()
    return {p.stem: p for p in sorted(d.glob("*.md"))} if d.is_dir() else {}


def title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("page", nargs="?", help="the page's name, e.g. analysis (or analysis.md)")


def run(args: argparse.Namespace) -> int:
    found = pages()
    if not found:
        raise CommandError(f"the manual is not there ({manual_dir()}): this install has no "
                           "copy of docs/", code=1)
    if args.page is None:
        width = max(map(len, found))
        print(f"the manual ({manual_dir()}); `gputrace docs PAGE` prints a page:")
        for name, path in found.items():
            print(f"  {name:<{width}}  {title(path)}")
        return 0
    name = args.page.removesuffix(".md").removeprefix("docs/")
    if name not in found:
        raise CommandError(f"no page {args.page!r} in the manual; pages: {', '.join(found)}")
    text = found[name].read_text(encoding="utf-8")
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(text))
    else:
        sys.stdout.write(text)
    return 0
