"""The terminal section of a windowed recording: the whole run's iteration time."""

from __future__ import annotations

from typing import IO, Any

import numpy as np
from rich.markup import escape

from gputrace.analyzers.extras.window import sparkline
from gputrace.fmt import mb
from gputrace.report import console


def _t(s: float) -> str:
    """A time as the rest of the output gives it: 1402.7 ms below 10 s, else 12.31 s."""
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


def render_window(w: dict[str, Any], file: IO[str] | None = None, one: bool = False) -> None:
    """The whole run's series and its window; `one`: one process, no rank to name."""
    con = console(file, None)
    win, run = w["window"], w["run"]
    t = np.array(run["t_iter_s"], float)
    what = ("on demand" if win.get("on_demand") else
            f"of the last {mb(win['max_size'])} (--max-size)"
            if "max_size" in win and not {"steps", "delay_s"} & set(win) else
            f"iterations {win['steps'][0]}..{win['steps'][0] + win['steps'][1] - 1}"
            if "steps" in win else
            f"{win.get('delay_s', 0):g} s after the start"
            + (f" for {win['duration_s']:g} s" if "duration_s" in win else ""))
    inside = (f"{win['iterations']} iterations in full detail "
              f"({win['first_step']}..{win['last_step']})" if win["iterations"]
              else "no iteration in full detail")
    con.print()
    who = "" if one else f" (rank {run['rank']})"
    con.print(f"[bold]The whole run[/]{who}: {run['iterations']} iterations; "
              f"window {escape(what)}: {inside}")
    if win.get("captured"):
        con.print("  opened on demand: " + ", ".join(
            f"{c['count']} from step {c['step']}" for c in win["captured"]))
    if len(win.get("windows") or []) > 1:
        con.print("  in full detail: " + ", ".join(
            f"{w['first_step']}..{w['last_step']}" for w in win["windows"]))
    s = run["summary"]
    if s:
        con.print(f"  iteration time: mean {_t(s['mean_s'])}, p50 {_t(s['p50_s'])}, p95 "
                  f"{_t(s['p95_s'])}, max {_t(s['max_s'])}")
        con.print(f"  {sparkline(t)}  [dim](max per column, iteration 0 to "
                  f"{run['step'][-1]})[/]")
        slow = ", ".join(f"{x['step']} ({_t(x['t_iter_s'])}"
                         + ("" if x["inside_window"] else ", outside") + ")"
                         for x in s["slowest"])
        con.print(f"  slowest: {slow}")
    if run["spikes"]:
        con.print("  spikes: " + ", ".join(f"{x['step']} ({_t(x['t_iter_s'])})"
                                           for x in run["spikes"][:8])
                  + (f" and {len(run['spikes']) - 8} more" if len(run["spikes"]) > 8 else ""))
    if run["finding"]:
        con.print(f"  [yellow]{escape(run['finding'])}[/]")
