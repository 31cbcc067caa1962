"""What the analysis withheld because an invariant did not hold (analyzers.findings.invariants): one
line per figure, the same words in the terminal, the report and the API."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from gputrace.analyzers import Analysis, RankAnalysis

SHARES = "the terms' shares of the iteration"


def withheld(a: Analysis, ra: RankAnalysis) -> list[tuple[str, str]]:
    """(figure, why) for the run's withheld figures and this rank's, each once."""
    out: dict[str, str] = {}
    for c in a.checks:
        if c.rank is None:
            out.setdefault(c.figure, c.why)
    for fig, why in ra.withheld.items():
        out.setdefault(fig, why)
    return list(out.items())


def shares_withheld(ra: RankAnalysis) -> bool:
    """The breakdown's shares are not to be given (its terms do not sum to t_iter)."""
    return SHARES in ra.withheld


def render_withheld(con: Console, a: Analysis, ra: RankAnalysis) -> None:
    """The terminal's lines, under the headline."""
    for fig, why in withheld(a, ra):
        con.print(f"[yellow]withheld[/]: {escape(fig)}: {escape(why)}")
