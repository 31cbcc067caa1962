"""The HTML pages the commands write: checked before any work, written after it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from gputrace.cli import CommandError

if TYPE_CHECKING:
    from gputrace.analysis.run import Compared
    from gputrace.analyzers import Analysis


def check_output(path: str) -> None:
    """Before any work: the plotting extra is there and the page can be written."""
    from gputrace.report.html import ReportUnavailable, available

    try:
        available()
    except ReportUnavailable as e:
        raise CommandError(str(e)) from None
    if os.path.isdir(path):
        raise CommandError(f"{path} is a directory; give the report a file name")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise CommandError(f"cannot write {path}: directory {d} does not exist")


def write(a: Analysis, path: str, rank: int | None, traces: list[str]) -> str:
    """Write the analysis' page; the line that says where it is."""
    from gputrace.report.document import page_parts
    from gputrace.report.html import write as write_html

    return _written(path, lambda: write_html(a, path, rank, " ".join(traces),
                                             *page_parts(a, rank, traces)))


def write_diff(c: Compared, path: str) -> str:
    """Write the diff's page; the line that says where it is."""
    from gputrace.report.diff_html import write as write_html

    return _written(path, lambda: write_html(c.doc, c.before, c.after, path))


def report_of(trace: str, path: str) -> str:
    """The page of a trace with the default options (`record --report`)."""
    from gputrace.analysis.run import AnalysisOptions, run_analysis

    return write(run_analysis(AnalysisOptions(inputs=(trace,)), detail=True), path, None,
                 [trace])


def _written(path: str, writer) -> str:  # type: ignore[no-untyped-def]
    from gputrace.report.html import ReportUnavailable

    try:
        n = writer()
    except OSError as e:
        raise CommandError(f"cannot write {path}: {e}") from None
    except ReportUnavailable as e:
        raise CommandError(str(e)) from None
    return f"report: {path} ({n / 1e6:.2f} MB), open it in a browser"
