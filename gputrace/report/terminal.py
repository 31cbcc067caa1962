"""The terminal report: headline first, then the numbers behind it."""

from __future__ import annotations

from typing import IO

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputrace.analyzers import Analysis, RankAnalysis
from gputrace.analyzers.core.model import UnitStats
from gputrace.analyzers.parallel import whatif_bands
from gputrace.analyzers.parallel.ddp.replay import Scenario
from gputrace.fmt import ranges, rate
from gputrace.report import console
from gputrace.report.checks import render_withheld, shares_withheld
from gputrace.report.collectives import headline_case, render_kinds, render_sharded
from gputrace.report.device import busy_line
from gputrace.report.goodput import goodput_line, render_goodput, render_run_only
from gputrace.report.parallel import render_parallel
from gputrace.report.solo import ProbeAdvice, iterations_line, link_text, shown_links, solo
from gputrace.report.throughput import rate_text, throughput_line
from gputrace.report.what_if import render_what_if, withheld_by_reason

PHASES = (("t_io", "waiting for data (I/O)"), ("t_h2d", "host to device copies"),
           ("t_f", "forward"), ("t_b", "backward"), ("t_u", "update (optimizer)"),
           ("t_comm", "gradient comm (all of it)"), ("t_other", "in no phase"))

FRAMEWORK = ("t_framework", "framework (its per-step work)")


def phase_rows(ra: RankAnalysis) -> tuple[tuple[str, str], ...]:
    """The breakdown's rows: the phases, and where a framework's own per-step work was
    measured (Keras's loop, logs and callbacks), its row before the time in no phase."""
    fw = ra.breakdown.get(FRAMEWORK[0])
    rows = PHASES
    if ra.collectives.sharded:
        rows = tuple((k, f"comm: {sharded_comm(ra)} (all of it)" if k == "t_comm"
                      else label) for k, label in rows)
    par = tuple((k, label) for k, label in PARALLEL if k in ra.breakdown)
    rows = (*rows[:-1], *par, rows[-1])
    if fw is None or not fw.mean > 0:
        return rows
    return (*rows[:-1], FRAMEWORK, rows[-1])


def sharded_comm(ra: RankAnalysis) -> str:
    """A sharded run's comm in words, by the kinds its units are: FSDP's and ZeRO-3's
    "all-gathers, reduce-scatters", DeepSpeed's ZeRO stage 0 "all-reduces" (data parallel,
    nothing gathered or scattered)."""
    ran = {k.kind for k in ra.collectives.kinds}
    kinds = [k.kind for k in ra.collectives.kinds if k.gradient and not k.small]
    if kinds and not {"all_gather", "reduce_scatter"} & ran:
        return ", ".join(dict.fromkeys(k.replace("_", "-") + "s" for k in kinds))
    return "all-gathers, reduce-scatters"


PARALLEL = (("t_tp", "tensor-parallel comm (exposed)"),
            ("t_pp", "pipeline bubble (stage idle, its waits)"),
            ("t_ep", "expert-parallel comm (exposed)"),
            ("t_cp", "context-parallel comm (exposed)"))


STRATEGY = {
    "sequential": "communication after backward (eq. 4/8)",
    "wfbp": "layer-wise overlap, update per layer (eq. 6/7/9)",
    "wfbp_update_after": "overlap with backward, update after all comm (eq. 10/11, as DDP)",
}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


def headline(ra: RankAnalysis) -> str:
    b = ra.breakdown
    t_iter = b["t_iter"].mean
    rows = phase_rows(ra)
    parts = {k: b[k].mean for k, _ in rows if k not in ("t_comm",)}
    parts["exposed comm"] = ra.comm["exposed_s"]
    top = max(parts, key=lambda k: parts[k])
    names = dict(rows)
    top_name = names.get(top, top)
    m = ra.model
    if m.case == 1 and ra.comm["hidden_s"] < 0.5 * ra.comm["total_s"]:
        case = (f"Case 1 by the unit rule (no unit waits for the next), yet only "
                f"{ra.comm['hidden_s'] / ra.comm['total_s']:.0%} of comm overlaps compute")
    elif m.case == 1:
        case = "Case 1: gradient communication is hidden behind backward"
    elif m.case == 2:
        case = f"Case 2: gradient communication is exposed ({_exposed(m.units, m.C)})"
    elif ra.comm["total_s"] > 0 and b["t_b"].mean > 0:
        case = "communication runs after backward, not overlapped"
    elif ra.comm["total_s"] > 0:
        case = (f"{_ms(ra.comm['exposed_s'])} of {_ms(ra.comm['total_s'])} communication "
                "outside compute (no backward phase found)")
    else:
        case = "single process: no gradient communication"
    case = headline_case(ra) or case
    share = parts[top] / t_iter if t_iter else 0
    t = ra.throughput
    rate = f" ({rate_text(t.samples_per_s)} samples/s)" if t is not None else ""
    largest = f"Largest term: {top_name} ({_ms(parts[top])})" if shares_withheld(ra) else \
        f"Largest share: {top_name} ({_ms(parts[top])}, {share:.0%})"
    return f"{_ms(t_iter)} per iteration{rate}. {case}. {largest}.{_recompute(ra)}"


def _recompute(ra: RankAnalysis) -> str:
    """The headline's sentence on activation checkpointing, where its recompute is large
    (over analyzers.extras.recompute.LARGE of t_b)."""
    rc = ra.recompute
    if rc is None or not rc.large:
        return ""
    return (f" Activation checkpointing recomputes the forward in the backward: "
            f"{_ms(rc.mean_s)} per iteration, {rc.share_of_t_b:.0%} of t_b.")


def _exposed(units: list[UnitStats], C: int | None) -> str:
    """Which units of the table are exposed and what C is, in the table's terms."""
    exposed = [u.index for u in units[:-1] if not u.hidden]
    if not exposed:
        return "only the last unit"
    # exposed for queueing (it ends after the next unit's gradients are ready) or for
    # running where no compute hides it (after the backward, the job's thread standing in it)
    late = {u.index for u, nxt in zip(units[:-1], units[1:], strict=True)
            if u.end_s > nxt.ready_s}
    parts = []
    for ks, what in (([k for k in exposed if k in late], "end{} after the next unit's "
                      "gradients are ready"),
                     ([k for k in exposed if k not in late], "run{} outside compute")):
        if ks:
            parts.append(f"unit{'s' if len(ks) > 1 else ''} {ranges(ks)} "
                         + what.format("s" if len(ks) == 1 else ""))
    text = "; ".join(parts)
    if C is not None:
        text += (f"; C = {C}: the lowest layer {'they hold' if len(exposed) > 1 else 'it holds'},"
                 " counting from 1 at the input")
    return text


def render(a: Analysis, rank: int | None = None, file: IO[str] | None = None,
           width: int | None = None) -> bool:
    """Print the analysis; True where it advised running `gputrace probe` (said once)."""
    con = console(file, width)
    ra = a.ranks[rank] if rank is not None else a.main
    one, advise = solo(a, ra), ProbeAdvice()
    if render_run_only(con, a, ra):      # no training iteration in the window
        return advise.given
    con.print(f"[bold]{escape(headline(ra))}[/]")
    if (good := goodput_line(a, ra)) is not None:
        con.print(good)
    con.print(iterations_line(a, ra)
              + ("; no iteration marks: the whole trace is one window" if ra.synthetic_iterations
                 else ""))
    if ra.left_out_line:
        con.print(escape(ra.left_out_line))
    render_withheld(con, a, ra)
    con.print()

    t_iter = ra.breakdown["t_iter"].mean
    bt = Table(title="Where an iteration's time goes (mean ± std, like Table V)",
               title_justify="left", box=None, padding=(0, 2))
    bt.add_column("term")
    bt.add_column("", style="dim")
    bt.add_column("mean", justify="right")
    bt.add_column("± std", justify="right", style="dim")
    bt.add_column("share", justify="right")
    for key, label in (("t_iter", "iteration"), *phase_rows(ra)):
        if one and key == "t_comm":
            continue
        s = ra.breakdown[key]
        share = "-" if shares_withheld(ra) else "{:.0%}"
        # t_comm is all of the comm, hidden under compute too: the share of the iteration is
        # its exposed part's, on its own row (the terms with it sum to t_iter)
        whole = key in ("t_iter", "t_comm") or t_iter == 0
        bt.add_row(key, label, _ms(s.mean), _ms(s.std),
                   "" if whole else share.format(s.mean / t_iter))
        if key == "t_comm" and t_iter > 0:
            exposed = ra.comm.get("exposed_s", 0.0)
            bt.add_row("", "  of which exposed (the iteration waits)", _ms(exposed), "",
                       share.format(exposed / t_iter))
        rc = ra.recompute
        if key == "t_b" and rc is not None and rc.mean_s:
            of = f", {rc.share_of_t_b:.0%} of t_b" if rc.share_of_t_b is not None else ""
            bt.add_row("", f"  of which recompute (checkpointed forward{of})", _ms(rc.mean_s),
                       _ms(rc.std_s or 0.0), "")
    con.print(bt)
    for line in filter(None, (busy_line(ra), throughput_line(a, ra))):
        con.print(line)
    render_goodput(con, a, ra)
    con.print()

    ot = Table(title="Hidden vs exposed (per iteration)", title_justify="left", box=None,
               padding=(0, 2))
    for c in ("", "total", "hidden", "exposed", "hidden %"):
        ot.add_column(c, justify="right" if c else "left")
    comm = sharded_comm(ra) if ra.collectives.sharded else "gradient comm"
    for name, d in (((comm, ra.comm),) if not one else ()) + (("input I/O", ra.io),):
        ot.add_row(name, _ms(d["total_s"]), _ms(d["hidden_s"]), _ms(d["exposed_s"]),
                   f"{d['hidden_fraction']:.0%}")
    con.print(ot)
    if ra.comm_wait_s is not None:
        both, whole = ra.comm_wait_s + (ra.comm_transfer_s or 0), ra.comm["total_s"]
        # the two add up to the shared buckets' flight: said beside the comm above, so
        # that the figures visibly agree where they differ
        of = (f": {_ms(both)} of the {_ms(whole)} of {comm} (the rest is comm no other "
              "rank shows, or the rank's wait for comm that had ended)"
              if _ms(both) != _ms(whole) and both < whole and not one else "")
        con.print(f"comm across ranks: {_ms(ra.comm_wait_s)} waiting for peers, "
                  f"{_ms(ra.comm_transfer_s or 0)} transferring, per iteration{of}")
    render_kinds(con, ra)
    m = ra.model
    if m.units and ra.sharded is None:
        ut = Table(title="Gradient units in launch order (times from iteration start)",
                   title_justify="left", box=None, padding=(0, 2))
        for c in ("unit", "layers", "MB", "ready", "start", "end", "hidden"):
            ut.add_column(c, justify="left" if c == "layers" else "right")
        shown = m.units if len(m.units) <= 12 else m.units[:6] + m.units[-6:]
        for u in shown:
            layers = "?" if not u.layers else (
                str(u.layers[0]) if len(u.layers) == 1 else f"{min(u.layers)}-{max(u.layers)}")
            ut.add_row(str(u.index), layers, f"{u.nbytes / 1e6:.2f}" if u.nbytes == u.nbytes else "?", _ms(u.ready_s),
                       _ms(u.start_s), _ms(u.end_s),
                       "[green]yes[/]" if u.hidden else
                       ("last" if u is m.units[-1] else "[red]no[/]"))
        if len(m.units) > 12:
            con.print(f"({len(m.units) - 12} units not shown)")
        con.print(ut)
    render_sharded(con, ra)
    render_parallel(con, ra)
    con.print()
    strategy = STRATEGY.get(m.strategy, m.strategy) if ra.comm["total_s"] > 0 else \
        "single process, no gradient comm (eq. 1; eq. 4 with pipelined I/O)"
    if ra.dimensions and ra.sharded is None:
        strategy = (f"{ra.dimensions}: the phases, each dimension's exposed comm and the "
                    f"time in no phase, one after another (eq. {m.equation})")
    elif ra.comm_missing:
        strategy = (f"unknown: no {'gradient comm' if ra.collectives.in_iterations else 'collective'}"
                    f" recorded (eq. {m.equation} over the measured phases)")
    elif ra.sharded is not None:
        strategy = f"{ra.sharded.label}: sharded iteration (docs/sharded.md)"
    con.print(f"[bold]Model[/]: {strategy}" + (f", Case {m.case}" if m.case else ""))
    if not one or abs(m.relative_error) >= 5e-4:   # one process: the sum of its phases
        con.print(f"  eq. {m.equation} predicts {_ms(m.predicted_t_iter)} per iteration; "
                  f"measured {_ms(m.measured_t_iter)} ({m.relative_error:+.1%})")
    if m.eq7_t_iter is not None:
        con.print(f"  [dim]the paper's eq. 7 (exposed units end to end) gives "
                  f"{_ms(m.eq7_t_iter)}[/]")
    for n in m.notes:
        con.print(f"  [dim]{escape(n)}[/]")
    sp = ra.speedup
    if sp.unavailable:
        con.print(f"Predicted speedup: not computed ({escape(advise(sp.unavailable))})")
    if sp.points:
        st = Table(title=f"Predicted speedup (eq. {sp.equation}, from {sp.world_size} "
                   f"rank{'s' if sp.world_size != 1 else ''})", title_justify="left",
                   box=None, padding=(0, 2))
        rp = ra.replay
        replayed = {o.scenario.gpus: o for o in rp.outcomes if o.scenario == Scenario(
            o.scenario.gpus)} if rp is not None else {}
        for c in ("GPUs", "speedup", "efficiency", "t_iter") + \
                (("replay: speedup", "t_iter") if replayed else ()):
            st.add_column(c, justify="right")
        for p in sp.points:
            o = replayed.get(p.gpus)
            mine = ("withheld", "-", "-") if p.withheld else \
                (f"{p.speedup:.2f}x", f"{p.efficiency:.0%}", _ms(p.t_iter))
            theirs = ("-", "-") if not o else ("withheld", "-") if o.withheld else \
                (f"{o.speedup:.2f}x", _ms(o.t_iter))
            st.add_row(str(p.gpus), *mine, *theirs[:2 if replayed else 0])
        con.print(st)
        if any(p.gpus != sp.world_size for p in sp.points):   # another GPU count's error
            for line in whatif_bands.note(["gpu_count"]):
                con.print(f"  [dim]the replay's {escape(line)}; eq. {sp.equation}'s is not "
                          "measured[/]")
        withheld_by_reason(con, [(f"{p.gpus} GPUs", p.withheld) for p in sp.points if p.withheld])
        for asm in sp.assumptions:
            con.print(f"  [dim]assumes {escape(asm)}[/]")
        if sp.allreduce_efficiency is not None:
            con.print(f"  all-reduce efficiency (eq. 12): {sp.allreduce_efficiency:.1%} of "
                      f"{rate(sp.link_bytes_per_s or 0)}")
    if sp.allreduce_efficiency_withheld:
        con.print(f"  all-reduce efficiency: {escape(sp.allreduce_efficiency_withheld)}")
    if ra.sharded is not None:
        pass   # its what-ifs are above
    elif ra.replay is not None and ra.replay.outcomes:
        render_what_if(con, ra.replay, m.measured_t_iter, one)
    elif ra.replay_unavailable:
        con.print()
        con.print(f"[bold]What if[/]: not replayed: {escape(advise(ra.replay_unavailable))}")
    bw = ra.bandwidth
    # a link with nothing moved over it says nothing, nor one with less than its figure
    # shows (a job's page-cache reads of its own files: "0.0 MB at 0 MB/s")
    moved = shown_links(bw.links) if bw is not None else []
    if moved:
        con.print()
        con.print("Bandwidth: " + "; ".join(map(link_text, moved)))
        probe = a.metadata.get("probe")
        if isinstance(probe, dict):
            con.print(f"  [dim]peaks from `gputrace probe` on {escape(str(probe.get('host')))} "
                      f"at {escape(str(probe.get('created')))}[/]")
        else:
            con.print("  [dim]" + advise("no peaks to compare with: run `gputrace probe` once "
                      "on this host, and traces recorded afterwards carry them") + "[/]"
                      if not advise.given else "  [dim]no probed peaks to compare with[/]")
    if ra.findings:
        con.print()
        con.print("[bold]Findings[/]")
        colors = {"high": "red", "moderate": "yellow", "info": "cyan"}
        for f in ra.findings:
            con.print(f"  [{colors.get(f.severity, 'white')}]{f.severity:>8}[/]  "
                      f"{escape(f.message)}")
    if len(a.ranks) > 1:
        con.print()
        _ranks(con, a)
    return advise.given


def _ranks(con: Console, a: Analysis) -> None:
    """Every rank in one line when they are few; with many, the spread, the slowest and
    the outliers with why; host clock offsets when there are several hosts."""
    hosts = {x.host for x in a.ranks.values()}
    many = len(a.ranks) > 16
    if not many:
        con.print("per rank: " + ", ".join(
            f"{r}: {_ms(x.breakdown['t_iter'].mean)}" + (" (slowest)" if r == a.slowest_rank
                                                        else "")
            for r, x in sorted(a.ranks.items())) + "   (--rank R for one rank)")
    else:
        t = sorted(x.breakdown["t_iter"].mean for x in a.ranks.values())
        con.print(f"{len(a.ranks)} ranks on {len(hosts)} host{'s' if len(hosts) != 1 else ''}"
                  f": t_iter min {_ms(t[0])}, median {_ms(t[len(t) // 2])}, max {_ms(t[-1])}"
                  "   (--rank R for one rank, --json for every rank)")
    s = a.slowest_why
    if s is not None:
        where = f" on {escape(s.host)}" if len(hosts) > 1 and s.host else ""
        if s.excess_s > 0.01 * s.t_iter_s:
            con.print(f"slowest: rank {s.rank}{where}, {_ms(s.t_iter_s)} "
                      f"({s.excess_s * 1e3:+.1f} ms over the median rank; {escape(s.why)})")
        else:
            con.print(f"slowest: rank {s.rank}{where}, {_ms(s.t_iter_s)}; every rank is within "
                      "1 % of the median rank")
    if a.outliers:
        con.print(f"[yellow]outliers[/] ({len(a.outliers)}, slower than the median rank by "
                  "5 % and 3.5 robust std): " + "; ".join(
                      f"rank {o.rank}" + (f" ({escape(o.host)})" if len(hosts) > 1 else "")
                      + f" {_ms(o.t_iter_s)}: {escape(o.why)}" for o in a.outliers[:8])
                  + (f"; and {len(a.outliers) - 8} more" if len(a.outliers) > 8 else ""))
    c = a.clock
    if c is not None:
        con.print(f"host clocks, against {escape(c.reference)} (from the ends of comm units, "
                  "which every rank reaches at once)"
                  + ("" if c.applied else ", not applied (--no-align)") + ":")
        for h, hc in sorted(c.hosts.items()):
            if h == c.reference:
                continue
            if hc.offset_s is None:
                con.print(f"  {escape(h)}: [yellow]{escape(hc.note)}[/]")
            else:
                con.print(f"  {escape(h)}: {hc.offset_s * 1e3:+.3f} ms "
                          f"± {(hc.uncertainty_s or 0) * 1e3:.3f} ms ({hc.matched} units"
                          + (f", within [{hc.bounds_s[0] * 1e3:+.1f}, "
                             f"{hc.bounds_s[1] * 1e3:+.1f}] ms" if hc.bounds_s else "")
                          + (f"; {escape(hc.note)}" if hc.note else "") + ")")
