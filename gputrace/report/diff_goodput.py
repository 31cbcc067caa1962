"""The diff's whole-run table: goodput and each badput category before and after; with
several runs a side, each change's 95 % interval across the runs."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from gputrace.report.goodput import NAMES, SHOWN_S


def _s(x: float, sign: bool = False) -> str:
    p = "+" if sign and x > 0 else ""
    return f"{p}{x * 1e3:.0f} ms" if abs(x) < 1 else f"{p}{x:.2f} s"


def _ci(r: dict[str, Any]) -> str:
    """'[-120 ms, +40 ms]' ('no interval' where none is known)."""
    if r.get("low") is None:
        return "no interval"
    return f"[{_s(r['low'], True)}, {_s(r['high'], True)}]"


def _noise(r: dict[str, Any]) -> str:
    if r.get("low") is None:
        return ""
    return "beyond noise" if r["beyond_noise"] else "within noise"


def render_goodput(con: Any, doc: dict[str, Any]) -> None:
    d = doc.get("goodput")
    if not d:
        return
    g, w = d["goodput"], d["wall_s"]
    runs = d.get("runs") or {"before": 1, "after": 1}
    spread = g.get("low") is not None
    if spread:
        how = (f"means of {runs['before']} runs before, {runs['after']} after; goodput's "
               f"change {(g['change']) * 100:+.1f} points [{g['low'] * 100:+.1f}, "
               f"{g['high'] * 100:+.1f}], {_noise(g)}")
    else:
        how = "one value a run: no interval"
    t = Table(title=f"The whole run: goodput {g['before']:.0%} -> {g['after']:.0%}, wall "
              f"time {_s(w['before'])} -> {_s(w['after'])} ({how})",
              title_justify="left", box=None)
    cols = ["", "before", "after", "change"] + (["95 % interval", ""] if spread else [])
    for c in cols:
        t.add_column(c, justify="right" if c else "left")
    for k, r in d["categories"].items():
        if r["before"] or r["after"]:
            cells = [NAMES.get(k, k), _s(r["before"]), _s(r["after"]), _s(r["change"], True)]
            t.add_row(*cells, *([_ci(r), _noise(r)] if spread else []))
    con.print(t)
    out = d.get("stalls_outside_window_s") or {}
    if max(out.values(), default=0.0) >= SHOWN_S:
        con.print(f"  of the stalls, {_s(out['before'])} before and {_s(out['after'])} after "
                  "lie outside the recorded window, where data waits and other work are not "
                  "told apart")
    shut = d.get("not_closed") or {}
    if any(shut.values()):
        con.print("  " + ", ".join(f"{n} run{'s' if n > 1 else ''} {k}" for k, n in shut.items()
                                   if n)
                  + " not closed (killed?): the wall time ends at the last thing recorded")
