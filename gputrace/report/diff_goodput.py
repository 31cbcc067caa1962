"""The diff's whole-run table: goodput and each badput category before and after."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from gputrace.report.goodput import NAMES


def _s(x: float, sign: bool = False) -> str:
    p = "+" if sign and x > 0 else ""
    return f"{p}{x * 1e3:.0f} ms" if abs(x) < 1 else f"{p}{x:.2f} s"


def render_goodput(con: Any, doc: dict[str, Any]) -> None:
    d = doc.get("goodput")
    if not d:
        return
    g, w = d["goodput"], d["wall_s"]
    t = Table(title=f"The whole run: goodput {g['before']:.0%} -> {g['after']:.0%}, wall "
              f"time {_s(w['before'])} -> {_s(w['after'])} (one value a run: no interval)",
              title_justify="left", box=None)
    for c in ("", "before", "after", "change"):
        t.add_column(c, justify="right" if c else "left")
    for k, r in d["categories"].items():
        if r["before"] or r["after"]:
            t.add_row(NAMES.get(k, k), _s(r["before"]), _s(r["after"]), _s(r["change"], True))
    con.print(t)
