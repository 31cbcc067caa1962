"""The report's chart of each layer's efficiency: the FLOP/s its forward and its backward
achieved as a share of the peak (analyze --json's `flops`), bars in layer order, and below
them each layer's share of the iteration (a layer far below the peak matters as much as
the time it takes). A layer whose share is withheld (its FLOP/s above the peak) is left out,
and the caption says which and why."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers.core.layer_names import named
from gputrace.analyzers.extras.flops import withheld_line
from gputrace.report.chart_kit import PALETTE, WIDTH, Chart, _colour, _columns

PHASES = ("forward", "backward")


def flops_chart(f: dict[str, Any]) -> Chart | None:
    """From analyze --json's `flops` (document.extras); None where nothing was counted or
    no layer was timed."""
    if not f.get("counted"):
        return None
    rows = [ly for ly in f.get("layers") or []
            if ly.get("achieved_flops_per_s_f") is not None
            or ly.get("achieved_flops_per_s_b") is not None]
    if not rows:
        return None
    pk = f.get("peaks") or {}
    peak = (pk.get("vendor") or pk.get("probed") or {}).get("flops_per_s")
    # a layer whose share of the peak is withheld (above 100 %: analyzers.extras.flops) is left
    # out, and the caption says why
    held = withheld_line(rows) if peak else None
    if held:
        rows = [ly for ly in rows if not ly.get("share_of_peak_withheld")]
    label = [named(ly) for ly in rows]
    cols: dict[str, list[Any]] = {k: [] for k in ("layer", "label", "phase", "value",
                                                  "tflops_per_s", "flops", "t_ms")}
    for ly, lb in zip(rows, label, strict=True):
        for ph, suf, t in (("forward", "f", "t_f_s"), ("backward", "b", "t_b_s")):
            rate = ly.get(f"achieved_flops_per_s_{suf}")
            if rate is None:
                continue
            cols["layer"].append(ly["layer"])
            cols["label"].append(lb)
            cols["phase"].append(ph)
            cols["value"].append(rate / peak if peak else rate / 1e12)
            cols["tflops_per_s"].append(rate / 1e12)
            cols["flops"].append(ly[f"flops_{suf}"])
            cols["t_ms"].append(ly[t] * 1e3)
    data, flat = _columns(**cols)
    sdata, sflat = _columns(layer=[ly["layer"] for ly in rows], label=label,
                            share=[ly.get("share_of_iteration") for ly in rows])
    x = {"field": "label", "type": "nominal", "title": "layer",
         "sort": {"field": "layer", "order": "ascending"}, "axis": {"labelAngle": -40}}
    y = ({"field": "value", "type": "quantitative", "title": f"share of the peak "
          f"({f.get('peak_used')})", "axis": {"format": "%"}} if peak else
         {"field": "value", "type": "quantitative", "title": "achieved TFLOP/s (no peak known)"})
    tip = [{"field": "label", "title": "layer"}, {"field": "phase"},
           {"field": "tflops_per_s", "title": "TFLOP/s", "format": ".4g"},
           {"field": "flops", "title": "FLOPs", "format": ".4s"},
           {"field": "t_ms", "title": "ms per iteration", "format": ".3f"}]
    if peak:
        tip.insert(2, {"field": "value", "title": "share of the peak", "format": ".1%"})
    share_y = {"field": "share", "type": "quantitative", "title": "share of the iteration",
               "axis": {"format": "%"}}
    spec = {"vconcat": [
        {"width": WIDTH, "height": 220, "data": data, "transform": flat, "mark": "bar",
         "encoding": {"x": x, "xOffset": {"field": "phase", "sort": list(PHASES)}, "y": y,
                      "color": _colour("phase", PHASES, [PALETTE[p] for p in PHASES]),
                      "tooltip": tip}},
        {"width": WIDTH, "height": 90, "data": sdata, "transform": sflat,
         "mark": {"type": "bar", "color": "#9ca3af"},
         "encoding": {"x": {**x, "axis": {"labels": False, "title": None}}, "y": share_y,
                      "tooltip": [{"field": "label", "title": "layer"},
                                  {"field": "share", "title": "share of the iteration",
                                   "format": ".1%"}]}}]}
    caption = ((f"each layer's achieved FLOP/s as a share of the {f.get('peak_used')} peak "
                if peak else "each layer's achieved TFLOP/s (no peak known: run gputrace probe "
                "on this machine) ")
               + "(forward, backward), and below, its share of the iteration"
               + (f". {f['finding']}" if f.get("finding") else "")
               + (f". {held}" if held else ""))
    return Chart("flops", "Layer efficiency: achieved FLOP/s against the peak", caption, spec)
