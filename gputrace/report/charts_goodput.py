"""The report's chart of the whole run (analyzers.extras.goodput): each category as bands over the
rank's clock from its process's start (start-up, the training steps, each evaluation pass,
each checkpoint, the stalls between steps, the end), and the goodput bar under it: the
training steps' share of the wall time and each badput category's, side by side."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers.extras.goodput import CATEGORIES, WITHHELD, Goodput
from gputrace.report.chart_kit import WIDTH, Chart, _columns
from gputrace.report.goodput import NAMES, SHOWN_S, _s

# one colour per category, training first
COLOURS = {"training": "#2563eb", "startup": "#9ca3af", "evaluation": "#16a34a",
           "checkpointing": "#9333ea", "data_stalls": "#f58518", "stalls": "#dc2626",
           "shutdown": "#6b7280", "other": "#bab0ac"}
ORDER = ("training", *CATEGORIES)


def label(category: str) -> str:
    return "training steps" if category == "training" else NAMES.get(category, category)


def goodput_chart(ra: Any, one: bool = False) -> Chart | None:
    """From a rank's goodput; None without one or where it is withheld (its categories do
    not make its wall time). `one`: one process, no rank to name."""
    g: Goodput | None = ra.goodput
    if g is None or not g.bands or WITHHELD in ra.withheld:
        return None
    span = g.wall_s
    unit, div = ("h", 3600.0) if span >= 7200 else ("min", 60.0) if span >= 120 else ("s", 1.0)
    names = [label(c) for c, _, _ in g.bands]
    data, flat = _columns(what=names, start=[round(a / div, 6) for _, a, _ in g.bands],
                          end=[round(b / div, 6) for _, _, b in g.bands],
                          ms=[round((b - a) * 1e3, 3) for _, a, b in g.bands])
    shown = [c for c in ORDER if c == "training" or g.badput_s[c] > 0]
    colour = {"field": "what", "type": "nominal", "title": None,
              "scale": {"domain": [label(c) for c in shown],
                        "range": [COLOURS[c] for c in shown]}}
    bands = {
        "width": WIDTH, "height": 24 * len(shown), "data": data, "transform": flat,
        "mark": {"type": "bar", "tooltip": True},
        "encoding": {
            "x": {"field": "start", "type": "quantitative",
                  "title": f"time since the process's start ({unit})",
                  "scale": {"domain": [0, round(span / div, 6)]}},
            "x2": {"field": "end"},
            "y": {"field": "what", "type": "nominal", "title": None,
                  "sort": [label(c) for c in shown]},
            "color": colour,
            "tooltip": [{"field": "what"}, {"field": "start", "title": f"from ({unit})",
                                            "format": ".3f"},
                        {"field": "ms", "title": "ms", "format": ".1f"}]}}
    secs = [g.training_s if c == "training" else g.badput_s[c] for c in shown]
    bdata, bflat = _columns(what=[label(c) for c in shown],
                            share=[round(x / span * 100, 3) for x in secs],
                            s=[round(x, 4) for x in secs], order=list(range(len(shown))))
    bar = {
        "width": WIDTH, "height": 28, "data": bdata, "transform": bflat,
        "mark": {"type": "bar"},
        "encoding": {
            "x": {"field": "share", "type": "quantitative", "stack": "zero",
                  "title": "share of the wall time (%)", "scale": {"domain": [0, 100]}},
            "color": colour, "order": {"field": "order"},
            "tooltip": [{"field": "what"}, {"field": "s", "title": "s", "format": ".3f"},
                        {"field": "share", "title": "%", "format": ".1f"}]}}
    left = (f"; each category's {g.bands_left_out_s:.2f} s of shortest intervals beyond "
            "its 500 longest not drawn" if g.bands_left_out_s > 0 else "")
    caption = (f"Goodput {g.goodput:.0%}: {g.iterations} training steps took "
               f"{_s(g.training_s)} of {'the run' if one else f'rank {ra.rank}'}'s "
               f"{_s(g.wall_s)}; each category where "
               f"it lies on the run's clock, then the goodput bar{left}"
               + (f"; {_s(g.after_step_stalls_s)} of the stalls after a step's last phase"
                  if g.after_step_stalls_s >= SHOWN_S else "")
               + (f"; {_s(g.stalls_outside_window_s)} of the stalls outside the window, where "
                  "data waits and other work are not told apart"
                  if g.stalls_outside_window_s >= SHOWN_S else "")
               + ("; the run was not closed (killed?): its end is the last thing it recorded"
                  if g.ends_at == "last_record" else ""))
    return Chart("goodput", "The whole run: goodput and badput over the run's clock",
                 caption, {"vconcat": [bands, bar], "resolve": {"scale": {"color": "shared"}}})
