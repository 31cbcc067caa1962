"""The terminal's what-if section: the replay's grid of bucket sizes by GPU counts, then the
link bandwidth and asked scenarios, and the predictions withheld, one line per reason."""

from __future__ import annotations

import math
import re

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputrace.analyzers.parallel import whatif_bands as wb
from gputrace.analyzers.parallel.ddp.replay import MIB, Outcome, Replay
from gputrace.fmt import DDP_DEFAULT


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


def _bucket_label(b: float | None, n: int, measured_units: int) -> str:
    buckets = f"{n} bucket{'s' if n != 1 else ''}"    # was a bare '(1)'
    if b is None:
        return (f"measured ({n} unit{'s' if n != 1 else ''})" if measured_units
                else f"{DDP_DEFAULT}: {buckets}")
    return f"{'one bucket' if math.isinf(b) else f'bucket_cap_mb={b / MIB:g}'}" + \
        ("" if not n or math.isinf(b) else f": {buckets}")     # none: not replayed (withheld)


def render_what_if(con: Console, rp: Replay, measured: float, solo: bool = False) -> None:
    """The replay grid: bucket sizes x GPU counts, then link bandwidth and asked scenarios.
    `solo`: one process without comm, whose replay of the measured configuration is its
    measured iteration by construction (not said)."""
    con.print()
    grid = [o for o in rp.outcomes if o.scenario.bandwidth_x == 1]
    gpus = sorted({o.scenario.gpus for o in grid})
    rows: dict[float | None, dict[int, Outcome]] = {}
    for o in grid:
        rows.setdefault(o.scenario.bucket_bytes, {})[o.scenario.gpus] = o
    t = Table(title="What if: t_iter from a replay of the measured gradient timeline",
              title_justify="left", box=None, padding=(0, 2))
    t.add_column("buckets")
    for n in gpus:
        t.add_column(f"{n} GPUs", justify="right")
    def cell(o: Outcome) -> str:
        if o.withheld:
            return "withheld"
        band = wb.text(wb.band(rp.kind(o)))    # its measured error beside it, never bare
        return _ms(o.t_iter) + ("*" if o.extrapolated else "") + (f" {band}" if band else "")

    for b, by_n in rows.items():
        first = next(iter(by_n.values()))
        label = _bucket_label(b, first.buckets, rp.measured_units)
        t.add_row(label, *(cell(by_n[n]) if n in by_n else "-" for n in gpus))
    con.print(t)
    for o in rp.outcomes:
        label = o.scenario.label if rp.measured_units else \
            o.scenario.label.replace("measured buckets", DDP_DEFAULT)
        if o.scenario.bandwidth_x != 1 and o.withheld:
            con.print(f"  {escape(label)}: withheld")
        elif o.scenario.bandwidth_x != 1:
            # against the same GPU count at the link as it is: the change the link makes
            ref = o.reference_t_iter if not math.isnan(o.reference_t_iter) else measured
            what = "vs measured" if o.scenario.gpus == rp.cost.world and \
                rp.cost.source == "measured" else f"vs {o.scenario.gpus} GPUs at link x1"
            con.print(f"  {escape(label)}: {_ms(o.t_iter)}"
                      + (f" [{_ms(o.low)}, {_ms(o.high)}]" if not math.isnan(o.low) else "")
                      + f" ({o.t_iter / ref - 1:+.0%} {what}), {o.speedup:.2f}x over one GPU"
                      + ("*" if o.extrapolated else "")
                      + (f", measured error {wb.text(wb.band(rp.kind(o)))}"
                         if wb.band(rp.kind(o)) else ""))
    withheld_by_reason(con, [(o.scenario.label, o.withheld) for o in rp.outcomes if o.withheld])
    spread = [o for o in rp.outcomes if not math.isnan(o.low)]
    if spread:
        w = max((o.high - o.low) / 2 / o.t_iter for o in spread if o.t_iter > 0)
        con.print(f"  [dim]95 % intervals from resampling the analyzed iterations: within "
                  f"±{w:.0%} (each in --json); * leaves what the run measured (more GPUs, "
                  "another link, units of other sizes)[/]")
    con.print("  [dim]" + ("" if solo else "replaying the measured configuration gives "
                           f"{_ms(rp.baseline_t_iter)} ({rp.baseline_error:+.1%}); ")
              + "each prediction is the measured iteration plus the replayed change[/]")
    for line in wb.note([rp.kind(o) for o in rp.outcomes if not o.withheld]):
        con.print(f"  [dim]{escape(line)}[/]")
    for a in rp.assumptions:
        con.print(f"  [dim]assumes {escape(a)}[/]")


def withheld_by_reason(con: Console, which: list[tuple[str, str | None]]) -> None:
    """One line for the predictions not shown for the same reason (its figures aside), and
    why."""
    kinds: dict[str, list[tuple[str, str | None]]] = {}
    for w in which:
        kinds.setdefault(re.sub(r"[\d.]+", "#", w[1] or ""), []).append(w)
    for same in kinds.values():
        first, why = same[0]
        more = f" (and {len(same) - 1} more like it)" if len(same) > 1 else ""
        con.print(f"  [yellow]withheld[/]: {escape(first)}{more}: {escape(why or '')}")
