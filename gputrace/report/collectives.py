"""The terminal's sections on collectives: a multi-rank trace without any, collectives by
kind, and a sharded (FSDP) run's units, Cases and what-ifs."""

from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputrace.analyzers import RankAnalysis
from gputrace.analyzers.core.collective_totals import KindTotal
from gputrace.analyzers.parallel import whatif_bands as wb
from gputrace.report.parallel import dims_headline

ROLE = {"unshard": "forward all-gather", "reshard_gather": "backward re-gather",
        "reduce_grad": "reduce-scatter", "hsdp_all_reduce": "HSDP all-reduce",
        "step_gather": "step all-gather"}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


def headline_case(ra: RankAnalysis) -> str | None:
    """The headline's clause about comm when collectives decide it, else None."""
    if ra.dimensions:
        return dims_headline(ra)
    if ra.comm_missing:
        head = ra.comm_missing.split(": the ranks'")[0]
        what = "gradient exchange" if "no gradient" in head else "communication"
        return f"{head}: the ranks' {what} is not in this trace, so no comm figure or speedup"
    if ra.sharded is not None:
        return ra.sharded.headline()
    return None


DIM_WORDS = {"tp": "tensor parallel (activations)", "pp": "pipeline (between stages)",
             "ep": "expert parallel (dispatch, combine)", "cp": "context parallel"}


def few_bytes(n: float) -> str:
    """A small byte count as people say it: '1 KiB', '300 B'."""
    return "1 KiB" if n == 1024 else f"{n:.0f} B"


def in_model(ra: RankAnalysis, k: KindTotal) -> str:
    """What the model makes of a kind's collectives: the words of the kinds table."""
    if k.dim == "ep" and k.kind == "all_reduce":
        return "expert parallel (the capacity agreed before dispatch)"
    if k.dim in DIM_WORDS:
        return DIM_WORDS[k.dim]
    if k.dim == "other" and k.why and not k.small and not k.why.startswith("not gradient"):
        return f"other: {escape(k.why)}"     # why it serves no parallelism
    # data parallel beside the sharded model (DeepSpeed's engine at ZeRO stage 0)
    if ra.sharded is not None and not k.small and k.dim != "dp":
        return "sharded"
    if k.small:
        return (f"other (under {few_bytes(ra.collectives.small_below)} each, not gradient: a "
                "norm, a flag)")
    return "gradient" if k.gradient else "other (not gradient)"


def render_kinds(con: Console, ra: RankAnalysis) -> None:
    """Per-kind totals, when the rank issued collectives besides DDP's buckets."""
    c = ra.collectives
    if not c.kinds or (len(c.kinds) == 1 and c.kinds[0].gradient and ra.sharded is None):
        return
    t = Table(title="Collectives by kind (per iteration)", title_justify="left", box=None,
              padding=(0, 2))
    for h in ("kind", "count", "MB in", "time", "exposed", "in the model"):
        t.add_column(h, justify="left" if h in ("kind", "in the model") else "right")
    for k in c.kinds:
        t.add_row(k.kind, f"{k.count:.3g}", f"{k.nbytes / 1e6:.2f}", _ms(k.time_s),
                  _ms(k.exposed_s), in_model(ra, k))
    con.print(t)


def render_sharded(con: Console, ra: RankAnalysis) -> None:
    sh = ra.sharded
    if sh is None:
        return
    con.print()
    t = Table(title=f"{sh.label} units (means per iteration; times from iteration start)",
              title_justify="left", box=None, padding=(0, 2))
    for h in ("unit", "name", "collective", "MB", "start", "end", "exposed", "prefetched"):
        t.add_column(h, justify="left" if h in ("name", "collective") else "right")
    rows = sh.units if len(sh.units) <= 40 else sh.units[:20] + sh.units[-20:]
    for u in rows:
        what = u.kind.replace("_", "-") if u.role == "reduce_grad" else ROLE.get(u.role, u.role)
        t.add_row(str(u.unit), escape(u.name or "(root)"), what,
                  f"{u.nbytes / max(u.count, 1e-9) / 1e6:.2f}", _ms(u.start_s), _ms(u.end_s),
                  ("[red]" if u.exposed_s > 0.1 * u.duration_s * u.count else "[green]")
                  + _ms(u.exposed_s) + "[/]", f"{u.prefetched:.0%}")
    con.print(t)
    if len(sh.units) > 40:
        con.print(f"({len(sh.units) - 40} rows not shown; all in --json)")
    ex = sh.exposed
    step = f", step {_ms(ex['update_s'])}" if ex.get("update_s") else ""
    knobs = (f"; prefetch depth forward {sh.prefetch['forward']}, backward "
             f"{sh.prefetch['backward']}; reshard_after_forward "
             f"{'on' if sh.reshard_after_forward else 'off'}"
             if sh.strategy.startswith("fsdp") and sh.settings is None else "")
    con.print(f"exposed: forward {_ms(ex['forward_s'])} (Case {sh.cases['forward']}), "
              f"backward {_ms(ex['backward_s'])} (Case {sh.cases['backward']}){step}{knobs}")
    if sh.settings is not None:   # as the job set them, not inferred
        con.print(f"settings (read from the job): {escape(sh.settings.text())}")
    con.print()
    w = Table(title="What if: t_iter from a replay of the measured sharded timeline",
              title_justify="left", box=None, padding=(0, 2))
    kinds = [wb.kind_of_label(o.label) for o in sh.what_if]
    # a kind measured off by more than 10 % is shown with its band (analyzers.parallel.whatif_bands)
    errs = [wb.cell(k) for k in kinds]
    banded = any(e and not o.withheld for e, o in zip(errs, sh.what_if, strict=True))
    for h in ("change", "t_iter", "95 % interval", "vs measured", "exposed",
              *(("measured error",) if banded else ())):
        w.add_column(h, justify="left" if h == "change" else "right")
    m = sh.model.measured_t_iter
    for o, e in zip(sh.what_if, errs, strict=True):
        if o.withheld:
            w.add_row(escape(o.label), "withheld", "-", "-", "-", *(("-",) if banded else ()))
            continue
        iv = "-" if math.isnan(o.low) else f"[{_ms(o.low)}, {_ms(o.high)}]"
        w.add_row(escape(o.label), _ms(o.t_iter), iv, f"{o.t_iter / m - 1:+.0%}" if m else "-",
                  _ms(o.exposed_s), *((e,) if banded else ()))
    con.print(w)
    held = [o for o in sh.what_if if o.withheld]
    if held:
        more = f" (and {len(held) - 1} more like it)" if len(held) > 1 else ""
        con.print(f"  [yellow]withheld[/]: {escape(held[0].label)}{more}: "
                  f"{escape(held[0].withheld or '')}")
    con.print(f"  [dim]replaying the measured configuration gives {_ms(sh.baseline_t_iter)} "
              f"({sh.baseline_error:+.1%}); each prediction is the measured iteration plus the "
              "replayed change[/]")
    for line in wb.note([k for k, o in zip(kinds, sh.what_if, strict=True) if not o.withheld]):
        con.print(f"  [dim]{escape(line)}[/]")
    for a in sh.assumptions:
        con.print(f"  [dim]assumes {escape(a)}[/]")
