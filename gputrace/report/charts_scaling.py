"""The report's scaling charts: speedup and efficiency for N GPUs (the model's equation and
the replay), and the what-if predictions with their intervals."""

from __future__ import annotations

import html
import math
from typing import Any

from gputrace.analyzers import RankAnalysis
from gputrace.analyzers.parallel import whatif_bands as wb
from gputrace.analyzers.parallel.ddp.replay import MIB, Scenario
from gputrace.fmt import DDP_DEFAULT
from gputrace.report.chart_kit import WIDTH, Chart, _colour, _columns, _ms, _rule


def speedup(ra: RankAnalysis) -> Chart | None:
    sp = ra.speedup
    points = [p for p in sp.points if p.withheld is None]   # a withheld one: no figure
    if not points:
        return None
    model = f"model (eq. {sp.equation})"
    series = [(model, p.gpus, p.speedup, p.efficiency) for p in points]
    rp = ra.replay
    if rp is not None:
        series += [("replay", o.scenario.gpus, o.speedup, o.speedup / o.scenario.gpus)
                   for o in rp.outcomes if o.scenario == Scenario(o.scenario.gpus)
                   and o.withheld is None]
    series += [("ideal", p.gpus, float(p.gpus), 1.0) for p in points]
    names = list(dict.fromkeys(s for s, _, _, _ in series))
    data, flat = _columns(series=[s for s, _, _, _ in series], gpus=[g for _, g, _, _ in series],
                          speedup=[round(v, 4) for _, _, v, _ in series],
                          efficiency=[round(e, 4) for _, _, _, e in series])
    gpus = sorted({g for _, g, _, _ in series})
    x = {"field": "gpus", "type": "quantitative", "title": "GPUs",
         "scale": {"type": "log", "base": 2}, "axis": {"values": gpus, "format": "d"}}
    colour = _colour("series", names, [{"replay": "#f58518", "ideal": "#bab0ac"}.get(
        n, "#4c78a8") for n in names], "bottom")

    def panel(field: str, title: str, fmt: str) -> dict[str, Any]:
        return {"width": WIDTH // 2 - 60, "height": 240,
                "mark": {"type": "line", "point": True},
                "encoding": {"x": x, "y": {"field": field, "type": "quantitative",
                                           "title": title, "axis": {"format": fmt}},
                             "color": colour,
                             "strokeDash": {"condition": {"test": "datum.series === 'ideal'",
                                                          "value": [4, 3]}, "value": [1, 0]},
                             "tooltip": [{"field": "series"}, {"field": "gpus"},
                                         {"field": "speedup", "format": ".2f"},
                                         {"field": "efficiency", "format": ".0%"}]}}

    spec = {"data": data, "transform": flat,
            "hconcat": [panel("speedup", "speedup (weak scaling)", ".1f"),
                        panel("efficiency", "efficiency (speedup / GPUs)", ".0%")]}
    return Chart("speedup", "Predicted speedup and efficiency vs GPU count",
                 f"The paper's eq. {sp.equation} from the measured terms beside the replay of "
                 "the measured gradient timeline: the gap to the dashed ideal is what comm "
                 "costs at each size.", spec)


def _config(s: Scenario, measured_units: int = 1) -> str:
    b = (("measured buckets" if measured_units else DDP_DEFAULT) if s.bucket_bytes is None
         else "one bucket" if math.isinf(s.bucket_bytes)
         else f"bucket_cap_mb={s.bucket_bytes / MIB:g}")
    return b + ("" if s.bandwidth_x == 1 else f", link x{s.bandwidth_x:g}")


def what_if(ra: RankAnalysis) -> Chart | None:
    rp = ra.replay
    outs = [o for o in rp.outcomes if o.withheld is None] if rp is not None else []
    if rp is None or not outs:
        return None
    configs = list(dict.fromkeys(_config(o.scenario, rp.measured_units) for o in outs))
    data, flat = _columns(gpus=[o.scenario.gpus for o in outs],
                          config=[_config(o.scenario, rp.measured_units) for o in outs],
                          t_iter=_ms([o.t_iter for o in outs]),
                          buckets=[o.buckets for o in outs],
                          comm=_ms([o.comm_s for o in outs]),
                          exposed=_ms([o.exposed_s for o in outs]),
                          speedup=[round(o.speedup, 4) for o in outs],
                          low=[None if math.isnan(o.low) else round(o.low * 1e3, 4)
                               for o in outs],
                          high=[None if math.isnan(o.high) else round(o.high * 1e3, 4)
                                for o in outs],
                          extrapolated=[o.extrapolated or "no" for o in outs],
                          error=[wb.cell(rp.kind(o)) or "-" for o in outs])
    x = {"field": "gpus", "type": "ordinal", "title": "GPUs"}
    offset = {"field": "config", "type": "nominal", "sort": configs}
    spec = {
        "width": WIDTH, "height": 280,
        "layer": [
            {"data": data, "transform": flat, "mark": "bar",
             "encoding": {
                 "x": x, "xOffset": offset,
                 "y": {"field": "t_iter", "type": "quantitative", "title": "t_iter (ms)"},
                 "opacity": {"condition": {"test": "datum.extrapolated !== 'no'",
                                           "value": 0.55}, "value": 1},
                 "color": {"field": "config", "type": "nominal", "sort": configs,
                           "scale": {"scheme": "tableau10"},
                           "legend": {"title": None, "orient": "right"}},
                 "tooltip": [{"field": "config"}, {"field": "gpus"},
                             {"field": "t_iter", "format": ".1f", "title": "t_iter (ms)"},
                             {"field": "buckets"},
                             {"field": "comm", "format": ".1f", "title": "comm (ms)"},
                             {"field": "exposed", "format": ".1f",
                              "title": "exposed after backward (ms)"},
                             {"field": "speedup", "format": ".2f"},
                             {"field": "low", "format": ".1f", "title": "95 % from (ms)"},
                             {"field": "high", "format": ".1f", "title": "95 % to (ms)"},
                             {"field": "extrapolated"},
                             {"field": "error", "title": "measured error"}]}},
            {"data": data, "transform": [*flat, {"filter": "isValid(datum.low)"}],
             "mark": {"type": "rule", "color": "black", "strokeWidth": 1.5},
             "encoding": {"x": x, "xOffset": offset,
                          "y": {"field": "low", "type": "quantitative"},
                          "y2": {"field": "high"}}},
            _rule("y", rp.measured_t_iter * 1e3),
        ],
    }
    return Chart("what-if", "What if: replayed t_iter for other GPU counts, buckets and links",
                 "Each bar is the measured iteration plus the replayed change of its gradient "
                 "tail, with its 95 % interval from resampled iterations (dashed: measured "
                 "t_iter); faded bars extrapolate past what the run measured: a lower bar at "
                 "the run's own GPU count is a setting worth trying."
                 + "".join(f" {html.escape(x[:1].upper() + x[1:])}."
                         for x in wb.note([rp.kind(o) for o in outs])),
                 spec)


# which chart shows the evidence of each finding (by id, or id prefix ending in "_")
