"""The report's chart of a windowed recording's whole run: every iteration's time over the
run's clock, the window's iterations apart, the spikes marked with their step and time (a
slow-down, a checkpoint or an evaluation every N iterations shows where and when)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gputrace.report.chart_kit import Chart, _columns


def run_chart(w: dict[str, Any]) -> Chart | None:
    """From analyze --json's `window` and `run` (document.extras); None without iterations."""
    run = w["run"]
    t = np.asarray(run["t_iter_s"], float)
    if not t.size:
        return None
    # each one's start from the first's (what lies between them included); a document
    # without it: the iterations as if they tiled the run
    start = np.asarray(run["start_s"], float) if "start_s" in run else np.cumsum(t) - t
    span = float((start + t).max())
    unit, div = ("h", 3600.0) if span >= 7200 else ("min", 60.0) if span >= 120 else ("s", 1.0)
    at = start / div
    inside = ["in full detail" if x else "times only" for x in run["inside_window"]]
    data, flat = _columns(at=at.round(6).tolist(), ms=(t * 1e3).round(4).tolist(),
                          step=run["step"], where=inside)
    spikes = {s["step"] for s in run["spikes"]}
    sp_at = [float(a) for a, s in zip(at, run["step"], strict=True) if s in spikes]
    sp_ms = [float(m) for m, s in zip(t * 1e3, run["step"], strict=True) if s in spikes]
    sp_step = [s for s in run["step"] if s in spikes]
    sdata, sflat = _columns(at=sp_at, ms=sp_ms, step=sp_step)
    x = {"field": "at", "type": "quantitative", "title": f"time since the first iteration "
         f"({unit})"}
    y = {"field": "ms", "type": "quantitative", "title": "iteration (ms)",
         "scale": {"type": "log"} if t.max() > 20 * np.median(t) else {}}
    tip = [{"field": "step"}, {"field": "ms", "title": "ms", "format": ".2f"},
           {"field": "at", "title": unit, "format": ".3f"}]
    marks = [{"data": sdata, "transform": sflat,
              "mark": {"type": "point", "shape": "triangle-down", "size": 80,
                       "color": "#dc2626"},
              "encoding": {"x": x, "y": y, "tooltip": tip}}] if spikes else []
    spec = {
        "width": 760, "height": 220,
        "layer": [
            {"data": data, "transform": flat, "mark": {"type": "point", "filled": True,
                                                       "size": 12},
             "encoding": {"x": x, "y": y, "tooltip": [*tip, {"field": "where"}],
                          "color": {"field": "where", "type": "nominal", "title": None,
                                    "scale": {"domain": ["times only", "in full detail"],
                                              "range": ["#9ca3af", "#2563eb"]}}}},
            *marks,     # the spikes: a layer of no data would have no extent
        ]}
    win = w["window"]
    caption = (f"{run['iterations']} iterations of rank {run['rank']}; "
               f"{win['iterations']} in full detail (blue)"
               + (f"; {len(spikes)} spike(s) marked in red" if spikes else "")
               + (f". {run['finding']}" if run["finding"] else ""))
    return Chart("run", "The whole run: every iteration's time", caption, spec)
