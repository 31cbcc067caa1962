"""The report's parts on tensor and pipeline parallelism (colours: charts.PALETTE):

- the pipeline as it ran in one iteration, stage by stage, as the GPipe and 1F1B papers draw
  it: a lane per stage (its rank), each microbatch's forward and backward a block labelled
  by its microbatch, the stage's schedule step behind them (the grey left showing is the
  bubble); beside it the stages' table and the pipeline's what-ifs;
- tensor parallelism: its collectives per layer, forward and backward, by the time the job
  stood in them (exposed), and the TP-degree what-if."""

from __future__ import annotations

import html
from typing import Any

from gputrace.analyzers import Analysis, RankAnalysis
from gputrace.analyzers.parallel import whatif_bands as wb
from gputrace.analyzers.parallel.pp import pipesim, pp, pp_whatif
from gputrace.report.chart_kit import PALETTE, WIDTH, Chart, _colour, _columns

BLOCKS = {"forward": ("forward", PALETTE["forward"]),
          "backward": ("backward", PALETTE["backward"]),
          "backward_weight": ("backward (weight)", "#88d27a"),
          "step": ("bubble (in the step, computing nothing)", "#e2e2e2")}
LABEL_MIN_PX = 12       # a block narrower than this on the page carries no label


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


def _table(rows: list[list[str]], header: list[str], tid: str) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table id="{e(tid)}"><tr>{head}</tr>{body}</table>'


def _assumptions(items: tuple[str, ...] | list[str]) -> str:
    return ('<ul class="caption">' + "".join(f"<li>assumes {html.escape(a)}</li>"
                                             for a in items) + "</ul>") if items else ""


def _offsets(a: Analysis) -> dict[int, int]:
    """Per rank, what puts its times on the report's one clock (its host's offset)."""
    if a.clock is None:
        return {}
    return {r: a.clock.offset_ns(ra.host) for r, ra in a.ranks.items()}


def pipeline(a: Analysis, ra: RankAnalysis) -> Chart | None:
    """One iteration of the pipeline, a lane per stage, with the stages' table and the
    what-ifs below it."""
    pl = ra.parallel.get("pp")
    it = pp.iteration(pl, _offsets(a)) if pl is not None else None
    if it is None:
        return None
    one = pp.first_replica(pl)
    held = sorted((k, s.rank) for s in one for k in (s.held or (s.stage,)))
    lanes = [f"stage {k} (rank {r})" for k, r in held]
    lane = {k: n for (k, _), n in zip(held, lanes, strict=True)}
    # the steps first: drawn under the blocks
    blocks = sorted(it.blocks, key=lambda b: (b.name != "step", b.stage, b.start_s))
    px = WIDTH / it.makespan_s if it.makespan_s > 0 else 0.0
    what = [BLOCKS.get(b.name, (b.name, "#333333"))[0] for b in blocks]
    data, flat = _columns(
        lane=[lane[b.stage] for b in blocks], what=what, mb=[b.mb for b in blocks],
        start=[round(b.start_s * 1e3, 4) for b in blocks],
        end=[round(b.end_s * 1e3, 4) for b in blocks],
        label=["" if b.name == "step" or (b.end_s - b.start_s) * px < LABEL_MIN_PX
               else str(b.mb) for b in blocks])
    present = [v for v, _ in BLOCKS.values() if v in what]
    colour = _colour("what", present, [c for v, c in BLOCKS.values() if v in present],
                     "bottom")
    colour["legend"]["labelLimit"] = 320
    y = {"field": "lane", "type": "nominal", "sort": lanes, "title": None,
         "axis": {"labelLimit": 220}}
    x = {"field": "start", "type": "quantitative",
         "title": f"ms from the first stage's step start (iteration step {it.step})"}
    tip = [{"field": "lane"}, {"field": "what"}, {"field": "mb", "title": "microbatch"},
           {"field": "start", "format": ".2f", "title": "start (ms)"},
           {"field": "ms", "format": ".2f", "title": "duration (ms)"}]
    spec = {
        "width": WIDTH, "height": {"step": 34}, "data": data,
        "transform": [*flat, {"calculate": "datum.end - datum.start", "as": "ms"}],
        "layer": [
            {"transform": [{"filter": f"datum.what === {BLOCKS['step'][0]!r}"}],
             "mark": {"type": "bar", "height": {"band": 0.9}},
             "encoding": {"y": y, "x": x, "x2": {"field": "end"}, "color": colour,
                          "tooltip": tip}},
            {"transform": [{"filter": f"datum.what !== {BLOCKS['step'][0]!r}"}],
             "mark": {"type": "bar", "height": {"band": 0.7}, "stroke": "white",
                      "strokeWidth": 0.5},
             "encoding": {"y": y, "x": x, "x2": {"field": "end"}, "color": colour,
                          "tooltip": tip}},
            {"transform": [{"filter": "datum.label !== ''"},
                           {"calculate": "(datum.start + datum.end) / 2", "as": "mid"}],
             "mark": {"type": "text", "color": "white", "fontSize": 10, "fontWeight": 600},
             "encoding": {"y": y, "x": {"field": "mid", "type": "quantitative"},
                          "text": {"field": "label"}}},
        ],
    }
    sched = pipesim.SHORT.get(pl.schedule, pl.schedule)
    idle = ", ".join(f"stage {s} {v:.0%}" for s, v in it.idle.items())
    caption = (f"{sched}, {pl.num_stages} stages x {pl.microbatches} microbatches. Each lane a "
               "stage, each block a microbatch's forward or backward labelled by its "
               "microbatch, as the pipelining papers draw them; the grey left showing is the "
               f"bubble. In this iteration (the first stage's median step) each stage computed "
               f"nothing for: {idle} of {_ms(it.makespan_s)}. Measured bubble "
               f"{pl.bubble:.0%} of the iteration (mean over stages and analyzed iterations); "
               f"the schedule's theory (p-1)/({'v·' if pl.stages_per_rank > 1 else ''}m+p-1) = "
               f"{pl.theory:.0%}.")
    return Chart("pipeline", "Pipeline: one iteration, stage by stage", caption, spec,
                 _pipeline_tables(pl))


def _first_up(s: str) -> str:
    return s[:1].upper() + s[1:]


def _pipeline_tables(pl: pp.Pipeline) -> str:
    rows = [[", ".join(str(k) for k in (s.held or (s.stage,)))
             + (" (slowest)" if s.stage == pl.slowest else ""), str(s.rank),
             _ms(s.forward_s), _ms(s.backward_s), _ms(s.busy_s), _ms(s.bubble_s),
             f"{s.bubble_s / s.t_iter:.0%}" if s.t_iter else "", _ms(s.waits_s),
             f"{s.p2p_count:.3g}"] for s in pl.stages]
    out = ["<h3>Stages (per iteration)</h3>",
           _table(rows, ["stage", "rank", "forward/mb", "backward/mb", "busy", "bubble",
                         "of t_iter", "waits", "p2p"], "pipeline-stages"),
           f'<p class="caption">Replayed step {_ms(pl.replayed_step_s)} with '
           f"{_ms(pl.transfer_s)} per transfer between stages (fitted to the measured "
           "step).</p>"]
    if pl.what_if:
        measured = pl.stages[0].t_iter
        banded = any(w.band for w in pl.what_if)
        rows = [[w.what, pipesim.SHORT.get(w.schedule, w.schedule), str(w.microbatches),
                 _ms(w.t_iter), f"{w.t_iter / measured:.2f}x" if measured else "",
                 f"{w.bubble:.0%}", *((f"{w.band[0]:+.0%} .. {w.band[1]:+.0%}"
                                       if w.band else "",) if banded else ())]
                for w in pl.what_if]
        out += ["<h3>What if: the pipeline replayed on the measured per-microbatch "
                "times</h3>",
                _table(rows, ["change", "schedule", "microbatches", "t_iter",
                              "of measured", "bubble",
                              *(("measured error",) if banded else ())],
                       "pipeline-what-if"),
                f'<p class="caption">Measured: {_ms(measured)} per iteration (the first '
                f"stage's), bubble {pl.bubble:.0%}."
                + (" " + html.escape(_first_up(pp_whatif.band_note(
                    pl.compute, pp_whatif.schedule_kinds(pl)))) + "." if banded else "")
                + "</p>",
                *(f'<p class="caption">{html.escape(t)}</p>' for t in _compute_notes(pl)),
                _assumptions(pl.assumptions)]
    return "".join(out)


def _compute_notes(pl: pp.Pipeline) -> list[str]:
    """What the what-ifs' compute per microbatch came from, and what given was not used (as
    the terminal says them)."""
    out = [f"--calibrate: {pl.calibration_used}."] if pl.calibration_used else []
    if pl.calibration_note:
        out.append(f"--calibrate not used: {pl.calibration_note}.")
    if pl.probe_note:
        out.append(f"--pp-probe's timings not used: {pl.probe_note}.")
    return out


def tensor_parallel(ra: RankAnalysis) -> Chart | None:
    """Per layer, the time the job stood in its TP collectives per iteration, forward and
    backward; the TP-degree what-if below."""
    tp = ra.dims.get("tp")
    if tp is None or not tp.layers:
        return None
    lanes: list[str] = []
    rows: list[tuple[str, str, float, float, float]] = []
    for x in sorted(tp.layers, key=lambda x: (x.layer < 0, x.layer)):
        name = f"layer {x.layer} {x.name}" if x.layer > 0 else "no layer known"
        if name not in lanes:
            lanes.append(name)
        rows.append((name, x.phase, x.exposed_s, x.count, x.nbytes))
    phases = [p for p in ("forward", "backward") if p in {r[1] for r in rows}]
    phases += sorted({r[1] for r in rows} - set(phases))
    data, flat = _columns(layer=[r[0] for r in rows], phase=[r[1] for r in rows],
                          ms=[round(r[2] * 1e3, 4) for r in rows],
                          count=[round(r[3], 3) for r in rows],
                          mb=[round(r[4] / 1e6, 4) for r in rows])
    spec = {
        "width": WIDTH, "height": {"step": 22}, "data": data, "transform": flat,
        "mark": "bar",
        "encoding": {
            "y": {"field": "layer", "type": "nominal", "sort": lanes, "title": None,
                  "axis": {"labelLimit": 220}},
            "x": {"field": "ms", "type": "quantitative", "stack": "zero",
                  "title": "ms per iteration the job stood in TP collectives (exposed)"},
            "color": _colour("phase", phases, [PALETTE.get(p, "#bab0ac") for p in phases],
                             "bottom"),
            "tooltip": [{"field": "layer"}, {"field": "phase"},
                        {"field": "ms", "format": ".2f", "title": "exposed ms per iteration"},
                        {"field": "count", "title": "collectives per iteration"},
                        {"field": "mb", "format": ".3f", "title": "MB per iteration"}]},
    }
    ph = ", ".join(f"{k} {_ms(v['exposed_s'])}" for k, v in tp.phases.items())
    mesh = f", mesh dimension {tp.mesh_dim!r}" if tp.mesh_dim else ""
    caption = (f"TP {tp.degree}{mesh}: {tp.count:.3g} collectives per iteration; the job "
               f"stood in them {_ms(tp.exposed_s)} of {_ms(tp.time_s)} ({ph}); hidden "
               f"{_ms(tp.hidden_s)} (asynchronous TP overlapping compute). A layer's "
               "forward collective is on its output, its backward one on its input's "
               "gradient: each is on the critical path unless hidden.")
    return Chart("tensor-parallel", "Tensor parallel: collectives per layer", caption, spec,
                 _tp_tables(tp))


def _tp_tables(tp: Any) -> str:   # tp.TensorParallel
    rows = [[str(x.layer) if x.layer > 0 else "?", x.name, x.phase, f"{x.count:.3g}",
             f"{x.nbytes / 1e6:.2f}", _ms(x.exposed_s)] for x in tp.layers]
    out = [_table(rows, ["layer", "name", "phase", "count", "MB", "exposed"], "tp-layers")]
    if tp.what_if:
        kinds = [wb.kind_of_degree(w.degree, tp.degree) for w in tp.what_if]
        rows = [[f"{w.degree}{' (measured)' if w.degree == tp.degree else ''}",
                 _ms(w.t_iter), f"{w.speedup:.2f}x", _ms(w.compute_s), _ms(w.comm_s),
                 wb.cell(k)] for w, k in zip(tp.what_if, kinds, strict=True)]
        out += ["<h3>What if: another TP degree (same model and global batch)</h3>",
                _table(rows, ["TP degree", "t_iter", "speedup", "compute", "TP comm",
                              "measured error"], "tp-what-if"),
                *(f'<p class="caption">{html.escape(x[:1].upper() + x[1:])}.</p>'
                  for x in wb.note(kinds)), _assumptions(tp.assumptions)]
    return "".join(out)
