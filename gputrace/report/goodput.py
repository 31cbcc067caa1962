"""The whole run in words: the goodput line under the headline, the badput table, and the
`goodput` document of `--json` (analyzers.extras.goodput)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from gputrace.analyzers.extras.goodput import CATEGORIES, FINDINGS, WITHHELD, Goodput, job
from gputrace.report.solo import one_process

LABELS = {"startup": "start-up (process start to the first training step)",
          "evaluation": "evaluation passes",
          "checkpointing": "checkpoint saves and loads (blocking part)",
          "data_stalls": "data stalls outside the iterations (loader starts, waits)",
          "stalls": "stalls between steps, nothing recorded at work",
          "shutdown": "shut-down (last training step to the end)",
          "other": "other work between steps (recorded, in no category)"}


NAMES = {"startup": "start-up", "shutdown": "shut-down", "data_stalls": "data stalls"}


def _s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if abs(x) < 1 else f"{x:.2f} s"


def run_samples_per_s(ra: Any) -> float | None:
    """Samples per second over the rank's whole run: every training step's samples over
    its wall time (the throughput's batch, the goodput's steps); None where either is
    unknown."""
    g, t = ra.goodput, ra.throughput
    if g is None or t is None or not g.wall_s > 0 or WITHHELD in ra.withheld:
        return None
    return float(t.samples * g.iterations / g.wall_s)


def goodput_line(a: Any, ra: Any) -> str | None:
    """The line under the headline: the training steps' share of the run and its largest
    badput."""
    g: Goodput | None = ra.goodput
    if g is None:
        return None
    if WITHHELD in ra.withheld:
        return f"[dim]goodput: withheld ({escape(ra.withheld[WITHHELD])})[/]"
    top = max(CATEGORIES, key=lambda k: g.badput_s[k])
    jg = job([r.goodput for r in a.ranks.values()]) if len(a.ranks) > 1 else None
    jt = f"; the job's {jg.goodput:.0%} over {jg.ranks} ranks" if jg is not None else ""
    return (f"Goodput {g.goodput:.0%}: training steps took {_s(g.training_s)} of the run's "
            f"{_s(g.wall_s)}{jt}; the largest badput is {NAMES.get(top, top)} "
            f"({_s(g.badput_s[top])}, {g.share(top):.0%})"
            + ("; the run was not closed (killed?): its end is the last thing it recorded"
               if g.ends_at == "last_record" else ""))


SHOWN_S = 0.0005     # a category's seconds the table gives a row: from 1 ms as printed


def render_goodput(con: Any, a: Any, ra: Any) -> None:
    """The small table of the run's time by category."""
    g: Goodput | None = ra.goodput
    if g is None or WITHHELD in ra.withheld:
        return
    who = "this process" if one_process(a) else "this rank"
    end = ", to the last thing recorded" if g.ends_at == "last_record" else ""
    t = Table(title=f"The whole run ({_s(g.wall_s)} on {who}{end})", title_justify="left",
              box=None, padding=(0, 2))
    for c in ("", "", "time", "share"):
        t.add_column(c, justify="right" if c else "left")
    t.add_row("training", f"{g.iterations} training steps", _s(g.training_s),
              f"{g.goodput:.0%}")
    for k in CATEGORIES:
        if g.badput_s[k] >= SHOWN_S:
            label = LABELS[k]
            if k == "startup" and "compile_s" in g.startup_parts_s:
                label = label[:-1] + ", and torch.compile's compilations)"
            if k == "shutdown" and g.ends_at == "last_record":
                label = "the last training step to the last thing recorded"
            if k == "shutdown" and g.shutdown_parts_s.get("pp_probe_s", 0.0) >= SHOWN_S:
                label += (f" ({_s(g.shutdown_parts_s['pp_probe_s'])} of it gputrace's "
                          "pipeline probe, record --pp-probe)")
            if k == "stalls" and g.after_step_stalls_s >= SHOWN_S:
                label += f" ({_s(g.after_step_stalls_s)} of it after a step's last phase)"
            if k == "stalls" and g.stalls_outside_window_s >= SHOWN_S:
                label += (f" ({_s(g.stalls_outside_window_s)} outside the window, where data "
                          "waits and other work are not told apart)")
            t.add_row(NAMES.get(k, k), label, _s(g.badput_s[k]), f"{g.share(k):.0%}")
    con.print(t)


def goodput_dict(ra: Any) -> dict[str, Any] | None:
    """A rank's `goodput` document: None where the trace does not hold the run or an
    invariant withheld it."""
    g: Goodput | None = ra.goodput
    if g is None or WITHHELD in ra.withheld:
        return None
    return {**g.as_dict(), "run_samples_per_s": run_samples_per_s(ra)}


def job_dict(a: Any) -> dict[str, Any] | None:
    """The job's: its ranks' seconds summed."""
    got = [r.goodput for r in a.ranks.values() if WITHHELD not in r.withheld]
    g = job(got)
    return g.as_dict() if g is not None else None


def no_iteration_in_window(ra: Any) -> str | None:
    """A windowed recording whose window holds no training iteration (the analysis took the
    whole trace as one): why its per-iteration figures are not given; None otherwise. Its
    goodput comes from the steps outside the window (their `run` entries)."""
    g: Goodput | None = ra.goodput
    if not ra.synthetic_iterations or g is None:
        return None
    return (f"No training iteration in the recorded window: the run's {g.iterations} "
            "training steps all lie outside it (their times only), so the per-iteration "
            "figures (phases, comm, model, speedup) are not given; the whole run below")


def render_run_only(con: Any, a: Any, ra: Any) -> bool:
    """The terminal for a window with no training iteration: that line, the goodput line
    and table and their findings; False where the window holds iterations."""
    why = no_iteration_in_window(ra)
    if why is None:
        return False
    con.print(f"[bold]{escape(why)}[/]")
    if (good := goodput_line(a, ra)) is not None:
        con.print(good)
    render_goodput(con, a, ra)
    found = [f for f in ra.findings if f.id in FINDINGS]
    if found:
        con.print()
        con.print("[bold]Findings[/]")
        colors = {"high": "red", "moderate": "yellow", "info": "cyan"}
        for f in found:
            con.print(f"  [{colors.get(f.severity, 'white')}]{f.severity:>8}[/]  "
                      f"{escape(f.message)}")
    return True
