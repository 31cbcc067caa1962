"""The terminal's sections on the parallelisms beyond data parallelism: the headline's
words, tensor parallelism (per phase, per layer, the TP-degree what-if), the pipeline (its
stages, the bubble beside the theory, its what-ifs) and expert parallelism (dispatch and
combine, bytes per peer, the imbalance across ranks)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from gputrace.analyzers import RankAnalysis
from gputrace.analyzers.parallel import whatif_bands as wb
from gputrace.analyzers.parallel.ep import ep_whatif
from gputrace.analyzers.parallel.pp import pipesim, pp_whatif
from gputrace.analyzers.parallel.registry import beyond_dp

_SHORT_DIM = {"tp": "TP", "pp": "PP", "ep": "EP", "cp": "CP"}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


def _kinds(d: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{v['count']:.3g} {k.replace('_', '-')}{'s' if v['count'] != 1 else ''}"
                     for k, v in d.items())


def dims_headline(ra: RankAnalysis) -> str:
    """The headline's clause for a run with tensor, pipeline or expert parallelism."""
    t_iter = ra.breakdown["t_iter"].mean
    clauses = []
    pl = ra.parallel.get("pp")
    if pl is not None:
        clauses.append(pl.headline())
    elif "t_pp" in ra.breakdown:
        b = ra.breakdown["t_pp"].mean
        clauses.append(f"pipeline bubble {_ms(b)} ({b / t_iter:.0%}) on this stage")
    tp = ra.dims.get("tp")
    if tp is not None:
        clauses.append(f"TP {_kinds(tp.kinds)} per iteration, {_ms(tp.exposed_s)} exposed "
                       f"({tp.exposed_s / t_iter:.0%})")
    ep = ra.dims.get("ep")
    if ep is not None:
        imb = ra.parallel.get("ep")
        clauses.append(f"EP {ep.count:.3g} all-to-alls{_capacity(ep)} per iteration, "
                       f"{_ms(ep.exposed_s)} "
                       f"exposed" + (f", the most-loaded rank {imb.ratio:.2f}x the mean"
                                     if imb is not None else ""))
    if ra.sharded is not None:
        clauses.append(ra.sharded.headline())
    told = {"pp"} if pl is not None or "t_pp" in ra.breakdown else set()
    told |= {d for d in ("tp", "ep") if d in ra.dims}
    for d in beyond_dp(ra.degrees):   # a dimension with no section of its own: its collectives
        if d in told:
            continue
        mine = {k.kind: {"count": k.count} for k in ra.collectives.kinds if k.dim == d}
        if mine:
            ex = sum(k.exposed_s for k in ra.collectives.kinds if k.dim == d)
            clauses.append(f"{_SHORT_DIM[d]} {_kinds(mine)} per iteration, {_ms(ex)} exposed")
    return f"{ra.dimensions}: " + ("; ".join(clauses) or "no collective of theirs analyzed")


def render_parallel(con: Console, ra: RankAnalysis) -> None:
    tp = ra.dims.get("tp")
    if tp is not None:
        _tp(con, ra, tp)
    pl = ra.parallel.get("pp")
    if pl is not None:
        _pp(con, pl)
    ep = ra.dims.get("ep")
    if ep is not None:
        _ep(con, ep, ra.parallel.get("ep"))


def _tp(con: Console, ra: RankAnalysis, tp) -> None:  # noqa: ANN001 - tp.TensorParallel
    con.print()
    t = Table(title=f"Tensor parallel (TP {tp.degree}"
              + (f", mesh dimension {tp.mesh_dim!r}" if tp.mesh_dim else "")
              + "): collectives per iteration", title_justify="left", box=None,
              padding=(0, 2))
    for h in ("layer", "name", "phase", "count", "MB", "exposed"):
        t.add_column(h, justify="left" if h in ("name", "phase") else "right")
    for x in tp.layers:
        t.add_row(str(x.layer) if x.layer > 0 else "?", x.name, x.phase, f"{x.count:.3g}",
                  f"{x.nbytes / 1e6:.2f}", _ms(x.exposed_s))
    con.print(t)
    ph = ", ".join(f"{k} {_ms(v['exposed_s'])}" for k, v in tp.phases.items())
    con.print(f"exposed {_ms(tp.exposed_s)} of {_ms(tp.time_s)} per iteration ({ph}); "
              f"hidden {_ms(tp.hidden_s)} (asynchronous TP overlapping compute)")
    if tp.what_if:
        w = Table(title="What if: another TP degree (same model and global batch)",
                  title_justify="left", box=None, padding=(0, 2))
        kinds = [wb.kind_of_degree(x.degree, tp.degree) for x in tp.what_if]
        for h in ("TP degree", "t_iter", "speedup", "compute", "TP comm", "measured error"):
            w.add_column(h, justify="right")
        for x, k in zip(tp.what_if, kinds, strict=True):
            w.add_row(f"{x.degree}{' (measured)' if x.degree == tp.degree else ''}",
                      _ms(x.t_iter), f"{x.speedup:.2f}x", _ms(x.compute_s), _ms(x.comm_s),
                      wb.cell(k))
        con.print(w)
        for line in wb.note(kinds):
            con.print(f"  {line}")
        for a in tp.assumptions:
            con.print(f"  assumes {a}")


def _pp(con: Console, pl) -> None:  # noqa: ANN001 - pp.Pipeline
    con.print()
    per = f", {pl.stages_per_rank} per rank" if pl.stages_per_rank > 1 else ""
    t = Table(title=f"Pipeline: {pl.num_stages} stages{per} x {pl.microbatches} microbatches "
              f"({pl.recorded_schedule + ', ' if pl.recorded_schedule else ''}"
              f"{pipesim.SHORT.get(pl.schedule, pl.schedule)}); per rank, per iteration",
              title_justify="left", box=None, padding=(0, 2))
    for h in ("stage" if pl.stages_per_rank == 1 else "stages", "rank", "forward/mb",
              "backward/mb", "busy", "bubble", "of t_iter", "waits", "p2p"):
        t.add_column(h, justify="right")
    for s in pl.stages:
        held = ", ".join(str(k) for k in (s.held or (s.stage,)))
        t.add_row(f"{held}{' (slowest)' if s.stage == pl.slowest else ''}", str(s.rank),
                  _ms(s.forward_s), _ms(s.backward_s), _ms(s.busy_s), _ms(s.bubble_s),
                  f"{s.bubble_s / s.t_iter:.0%}" if s.t_iter else "", _ms(s.waits_s),
                  f"{s.p2p_count:.3g}")
    con.print(t)
    f, b, _, _ = pl.per_stage
    if pl.stages_per_rank > 1 or any(pl.weight):
        con.print("per stage, per microbatch: " + "; ".join(
            f"stage {k} (rank {r}) forward {_ms(x)}, backward {_ms(y)}"
            + (f" (weight part {_ms(w)})" if w else "")
            for k, (r, x, y, w) in enumerate(zip(pl.rank_of, f, b, pl.weight or [0.0] * len(f),
                                                 strict=False))))
    v = "v·" if pl.stages_per_rank > 1 else ""
    con.print(f"bubble {pl.bubble:.0%} of the iteration (mean over ranks); the schedule's "
              f"theory (p-1)/({v}m+p-1) = {pl.theory:.0%} of its step"
              + (f"; replayed step {_ms(pl.replayed_step_s)} with {_ms(pl.transfer_s)} per "
                 "transfer (fitted)" if not pl.replay_note else
                 f"; not replayed: {pl.replay_note}"))
    if pl.calibration_used:
        con.print(f"  --calibrate: {pl.calibration_used}")
    if pl.calibration_note:
        con.print(f"  [yellow]--calibrate not used: {pl.calibration_note}[/yellow]")
    if pl.probe_note:
        con.print(f"  [yellow]--pp-probe's timings not used: {pl.probe_note}[/yellow]")
    if pl.what_if:
        c = pl.compute
        w = Table(title="What if: the pipeline replayed on the measured per-microbatch times"
                  + (f", fitted with the run at {c.calibrated_with} microbatches"
                     if c.calibrated_with else
                     f", the compute probed at {', '.join(map(str, c.probed))} rows inside the "
                     "run" if c.probed else ""),
                  title_justify="left", box=None, padding=(0, 2))
        banded = any(x.band for x in pl.what_if)
        for h in ("change", "schedule", "microbatches", "t_iter", "bubble",
                  *(("measured error",) if banded else ())):
            w.add_column(h, justify="left" if h in ("change", "schedule") else "right")
        for x in pl.what_if:
            w.add_row(x.what, pipesim.SHORT.get(x.schedule, x.schedule), str(x.microbatches),
                      _ms(x.t_iter), f"{x.bubble:.0%}",
                      *((f"{x.band[0]:+.0%} .. {x.band[1]:+.0%}" if x.band else "",)
                        if banded else ()))
        con.print(w)
        if banded:
            con.print(f"  {pp_whatif.band_note(c, pp_whatif.schedule_kinds(pl))}")
        for a in pl.assumptions:
            con.print(f"  assumes {a}")
        if c.calibrated_with or c.probed:
            con.print("  per microbatch, fixed + share of the batch: " + "; ".join(
                f"stage {k} forward {_ms(f[0])} + {_ms(f[1])}/m, backward {_ms(b[0])} + "
                f"{_ms(b[1])}/m" for k, (f, b) in enumerate(zip(c.forward, c.backward,
                                                                strict=True))))


def _capacity(ep) -> str:  # noqa: ANN001 - ep.ExpertParallel
    """' and N capacity all-reduces' where the MoE layers agreed their capacity."""
    n = ep.capacity
    return f" and {n:.3g} capacity all-reduce{'s' if n != 1 else ''}" if n else ""


def _ep(con: Console, ep, imb) -> None:  # noqa: ANN001 - ep.ExpertParallel, ep.Imbalance
    con.print()
    roles = ", ".join(f"{k} {v['count']:.3g} ({v['bytes'] / 1e6:.2f} MB, "
                      f"{_ms(v['exposed_s'])} exposed)" for k, v in ep.roles.items())
    con.print(f"Expert parallel (EP {ep.degree}): {ep.count:.3g} all-to-alls{_capacity(ep)} "
              "per iteration, "
              f"{ep.nbytes / 1e6:.2f} MB, {_ms(ep.exposed_s)} exposed; {ep.moe_layers} MoE "
              f"layer{'s' if ep.moe_layers != 1 else ''} in the forward: {roles}")
    if ep.roles_backward:
        con.print("in the backward: " + ", ".join(
            f"{k} {v['count']:.3g} ({v['bytes'] / 1e6:.2f} MB, {_ms(v['exposed_s'])} "
            "exposed)" for k, v in ep.roles_backward.items()))
    if ep.peers:
        names = ep.peer_ranks if len(ep.peer_ranks) == len(ep.peers) else \
            list(range(len(ep.peers)))
        con.print("bytes to each peer per iteration: "
                  + ", ".join(f"rank {i}: {b / 1e6:.2f} MB"
                              for i, b in zip(names, ep.peers, strict=True)))
    for g in imb.groups if imb is not None else ():
        head = f"EP group (ranks {', '.join(map(str, g.ranks))}): " if len(imb.groups) > 1 \
            else ""
        if g.tokens_by_rank:
            con.print(f"{head}imbalance: the most-loaded rank ({g.most_loaded}) receives "
                      f"{g.tokens_ratio:.2f}x the group's mean tokens ("
                      + ", ".join(f"rank {r}: {n:.0f}" for r, n in
                                  sorted(g.tokens_by_rank.items()))
                      + f" per iteration); bytes {g.ratio:.2f}x the mean")
        elif ep.even_splits:
            con.print(f"{head}imbalance: the dispatches move even splits, no split sizes "
                      "(capacity-padded buffers, as DeepSpeed-MoE's): every rank's experts "
                      "get as many slots whatever the routing, and the tokens routed, "
                      "dropped or padded are not in the comm; the most-loaded rank "
                      f"({g.most_loaded}) moves {g.ratio:.2f}x the group's mean bytes")
        else:
            con.print(f"{head}imbalance: the most-loaded rank ({g.most_loaded}) moves "
                      f"{g.ratio:.2f}x the group's mean bytes")
        if g.wait_s:
            cap = " (the capacity all-reduces before them included)" if ep.capacity else ""
            con.print(f"{head}wait in the all-to-alls for the group's last rank to enter "
                      f"them{cap}, per iteration: " + "; ".join(
                          f"rank {r} {_ms(w)}" + _layers(g.wait_by_layer.get(r, {}))
                          for r, w in sorted(g.wait_s.items())))
        if ep.even_splits and g.balanced_saves_s != g.balanced_saves_s:
            con.print(f"{head}what if routing were balanced: not predicted: with even "
                      "splits every rank's experts process as much whatever the routing; "
                      "what balance would change (the tokens dropped, or the capacity the "
                      "most-loaded expert sets, which even splits show only as it is) cannot "
                      "be told from the comm")
        elif g.balanced_saves_s == g.balanced_saves_s:
            saves = g.balanced_saves_s
            # a replay that takes longer balanced says so, never "-4.5 ms less"
            change = "no change" if abs(saves) < 5e-5 else \
                f"{_ms(saves)} less" if saves > 0 else f"{_ms(-saves)} more"
            con.print(f"{head}what if routing were balanced (each rank the group's mean "
                      f"tokens): the all-to-alls replayed give {change} per iteration; "
                      f"{ep_whatif.BAND}")


def _layers(by: dict[int, float]) -> str:
    """" (layer 1 3.1 ms, layer 2 2.0 ms)" where more than one layer is known."""
    known = {k: v for k, v in sorted(by.items()) if k > 0}
    if len(known) < 2:
        return ""
    rest = sum(v for k, v in by.items() if k <= 0)
    return " (" + ", ".join([f"layer {k} {_ms(v)}" for k, v in known.items()]
                            + ([f"other {_ms(rest)}"] if rest > 0 else [])) + ")"
