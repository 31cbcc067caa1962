"""The report's chart of memory over one iteration: the shown rank's memory at each phase
boundary of its median iteration (host RSS, and GPU allocated bytes where CUDA was used),
the phases shaded behind it, so which phase raises the memory and which gives it back shows
at a glance."""

from __future__ import annotations

from typing import Any

from gputrace.report.chart_kit import PALETTE, Chart, _colour, _columns

SERIES = {"rss": "host RSS", "cuda_allocated": "GPU {device} allocated"}


def memory_chart(ra: Any, rows: list[dict[str, Any]], m: dict[str, Any],
                 rank: int, one: bool = False) -> Chart | None:
    """`ra`: the shown rank's analysis (made with detail=True: its median iteration's
    timeline); `rows`: the trace's memory samples (analyzers.extras.memory.memory_rows), of which
    `rank`'s are drawn; `m`: analyze --json's `memory`. None without boundary samples in
    that iteration."""
    tl = getattr(getattr(ra, "detail", None), "timeline", None)
    if tl is None:
        return None
    lo, hi = tl.start_ns, tl.start_ns + int(tl.t_iter_s * 1e9)
    pts = sorted((r for r in rows if r["name"] in SERIES and r.get("args")
                  and r["rank"] == rank and lo <= r["start_ns"] <= hi),
                 key=lambda r: r["start_ns"])
    if len(pts) < 2:
        return None
    top = max(float(r["value"]) for r in pts)
    unit, div = ("GiB", 2.0 ** 30) if top >= 4 * 2.0 ** 30 else ("MiB", 2.0 ** 20)
    series = [SERIES[r["name"]].format(device=r["device"]) for r in pts]
    data, flat = _columns(ms=[round((r["start_ns"] - lo) / 1e6, 4) for r in pts],
                          v=[round(float(r["value"]) / div, 3) for r in pts],
                          series=series)
    bars = [b for b in tl.bars if b.lane == "host"]
    bdata, bflat = _columns(a=[round(b.start_s * 1e3, 4) for b in bars],
                            b=[round(b.end_s * 1e3, 4) for b in bars],
                            phase=[b.what for b in bars])
    phases = [p for p in PALETTE if p in {b.what for b in bars}]
    x = {"field": "ms", "type": "quantitative", "title": "time since the iteration began (ms)",
         "scale": {"domain": [0, round(tl.t_iter_s * 1e3, 3)]}}
    y = {"field": "v", "type": "quantitative", "title": f"memory ({unit})",
         "scale": {"zero": False}}
    layers: list[dict[str, Any]] = []
    if bars:
        layers.append({"data": bdata, "transform": bflat, "mark": {"type": "rect",
                                                                   "opacity": 0.25},
                       "encoding": {"x": {"field": "a", "type": "quantitative"},
                                    "x2": {"field": "b"},
                                    "color": _colour("phase", phases,
                                                     [PALETTE[p] for p in phases]),
                                    "tooltip": [{"field": "phase"}]}})
    layers.append({"data": data, "transform": flat,
                   "mark": {"type": "line", "point": True},
                   "encoding": {"x": x, "y": y,
                                "strokeDash": {"field": "series", "type": "nominal",
                                               "title": None},
                                "color": {"value": "#111827"},
                                "tooltip": [{"field": "series"},
                                            {"field": "v", "title": unit, "format": ".3f"},
                                            {"field": "ms", "title": "ms", "format": ".2f"}]}})
    spec = {"width": 760, "height": 220, "layer": layers,
            "resolve": {"scale": {"color": "independent"}}}
    ph = m.get("rss_peak_phase")
    peak = m.get("rss_peak_bytes")
    caption = (f"Step {tl.step} " + ("(the median iteration)" if one else
                                     f"of rank {rank} (its median iteration)")
               + ": the memory read at "
               "each phase's start and end"
               + (f"; the run's peak RSS, {peak / 2.0 ** 30:.2f} GiB, came in {ph}"
                  if peak and ph else "") + ".")
    return Chart("memory", "Memory over one iteration", caption, spec)
