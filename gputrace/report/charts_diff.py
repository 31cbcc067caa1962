"""The diff page's charts as Vega-Lite specifications, built from the `diff --json` document
(and, for the two timelines, from the analyses it was made of), so the page and the JSON say
the same thing."""

from __future__ import annotations

import copy
import html
from dataclasses import replace
from typing import Any

from gputrace.analyzers import RankAnalysis
from gputrace.report.chart_kit import PALETTE, WIDTH, Chart, _colour, _columns
from gputrace.report.charts import timeline

# the breakdown's terms that tile an iteration, bottom to top, and their colours (t_comm,
# all comm hidden or not, is not one of them: its exposed part is)
TILES = {"t_io": PALETTE["io"], "t_h2d": PALETTE["h2d"], "t_f": PALETTE["forward"],
         "t_b": PALETTE["backward"], "t_u": PALETTE["update"],
         "comm_exposed": PALETTE["comm exposed"], "t_tp": "#17becf", "t_pp": "#bcbd22",
         "t_ep": "#7f7f7f", "t_cp": "#aec7e8", "t_framework": PALETTE["framework"],
         "t_other": PALETTE["other"]}
REST = "rest (terms overlap or leave gaps)"
SLOWER, FASTER, TOTAL = "#e45756", "#54a24b", "#4c78a8"
RUNS = ("before", "after")


def _v(s: float | None) -> float | None:
    """Seconds as the charts' milliseconds."""
    return None if s is None else round(s * 1e3, 4)


def _ms(s: float | None, sign: bool = False) -> str:
    from gputrace.report.diff import _ms as ms

    return ms(s, sign)


def _ci(r: dict[str, Any]) -> str:
    if r.get("low") is None:
        return "no interval"
    return f"[{r['low'] * 1e3:+.2f}, {r['high'] * 1e3:+.2f}] ms"


def tiles(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The breakdown's terms that tile an iteration, in stack order, as the document has
    them (terms zero in both runs are not in it)."""
    return [(k, doc["breakdown"][k]) for k in TILES if k in doc["breakdown"]]


def breakdowns(doc: dict[str, Any]) -> Chart | None:
    """Both runs' mean iteration, stacked by term as the paper's Table V, one bar each."""
    terms = tiles(doc)
    if not terms:
        return None
    labels = [f"{k} {r['label']}" for k, r in terms]
    rows = [(run, label, j, _v(r[run])) for run in RUNS
            for j, ((_, r), label) in enumerate(zip(terms, labels, strict=True))]
    data, flat = _columns(run=[x[0] for x in rows], term=[x[1] for x in rows],
                          order=[x[2] for x in rows], ms=[x[3] for x in rows])
    t = doc["breakdown"]["t_iter"]
    tdata, tflat = _columns(run=list(RUNS), t_iter=[_v(t[run]) for run in RUNS])
    y = {"field": "run", "type": "nominal", "sort": list(RUNS), "title": None}
    x = {"field": "ms", "type": "quantitative", "stack": "zero", "title": "ms per iteration (mean)"}
    spec = {"width": WIDTH - 160, "height": {"step": 42}, "layer": [
        {"data": data, "transform": flat, "mark": {"type": "bar", "height": {"band": 0.7}},
         "encoding": {"y": y, "x": x,
                      "color": _colour("term", labels, [TILES[k] for k, _ in terms]),
                      "order": {"field": "order", "type": "quantitative"},
                      "tooltip": [{"field": "run"}, {"field": "term"},
                                  {"field": "ms", "format": ".2f", "title": "ms"}]}},
        {"data": tdata, "transform": tflat,
         "mark": {"type": "tick", "color": "black", "thickness": 2, "orient": "vertical"},
         "encoding": {"y": y, "x": {**x, "field": "t_iter", "stack": None},
                      "tooltip": [{"field": "run"}, {"field": "t_iter", "format": ".2f",
                                                     "title": "t_iter (ms)"}]}}]}
    return Chart("breakdowns", "Where an iteration's time goes, before and after",
                 "Each run's mean iteration stacked by term like the paper's Table V (black "
                 "tick: measured t_iter): the colour that grew or shrank is the change.", spec)


def waterfall(doc: dict[str, Any]) -> Chart | None:
    """t_iter before, each term's change on top of the last, t_iter after; the terms beyond
    noise in full colour, the others faded; a line across each step: its 95 % interval."""
    terms = tiles(doc)
    t = doc["breakdown"]["t_iter"]
    steps: list[tuple[str, float, float, dict[str, Any], str]] = [
        ("t_iter before", 0.0, t["before"], t, "total")]
    at = t["before"]
    for k, r in terms:
        steps.append((f"{k} {r['label']}", at, at + r["change"], r,
                      "slower" if r["change"] > 0 else "faster"))
        at += r["change"]
    rest = t["after"] - at
    if terms and abs(rest) > 1e-6:
        steps.append((REST, at, t["after"], {"change": rest}, "slower" if rest > 0 else "faster"))
    steps.append(("t_iter after", 0.0, t["after"], t, "total"))
    total = [s[4] == "total" for s in steps]
    data, flat = _columns(
        step=[s[0] for s in steps], order=list(range(len(steps))),
        start=[_v(s[1]) for s in steps], end=[_v(s[2]) for s in steps],
        change=[None if tot else _v(s[3]["change"]) for s, tot in zip(steps, total, strict=True)],
        low=[None if tot or s[3].get("low") is None else _v(s[1] + s[3]["low"]) for s, tot
             in zip(steps, total, strict=True)],
        high=[None if tot or s[3].get("high") is None else _v(s[1] + s[3]["high"]) for s, tot
              in zip(steps, total, strict=True)],
        beyond=[tot or bool(s[3].get("beyond_noise")) for s, tot in zip(steps, total,
                                                                         strict=True)],
        what=[s[4] for s in steps])
    x = {"field": "step", "type": "nominal", "sort": [s[0] for s in steps], "title": None,
         "axis": {"labelAngle": -30, "labelLimit": 200}}
    y = {"field": "start", "type": "quantitative", "title": "ms per iteration (mean)"}
    spec = {"width": WIDTH, "height": 300, "data": data, "transform": flat, "layer": [
        {"mark": {"type": "bar"},
         "encoding": {"x": x, "y": y, "y2": {"field": "end"},
                      "color": _colour("what", ("total", "slower", "faster"),
                                       (TOTAL, SLOWER, FASTER), "bottom"),
                      "opacity": {"condition": {"test": "datum.beyond", "value": 1},
                                  "value": 0.3},
                      "tooltip": [{"field": "step"},
                                  {"field": "change", "format": "+.3f", "title": "change (ms)"},
                                  {"field": "low", "format": ".3f", "title": "95 % low (ms)"},
                                  {"field": "high", "format": ".3f",
                                   "title": "95 % high (ms)"},
                                  {"field": "beyond", "title": "beyond noise"},
                                  {"field": "end", "format": ".3f", "title": "after it (ms)"}]}},
        {"transform": [{"filter": "isValid(datum.low)"}],
         "mark": {"type": "rule", "color": "black"},
         "encoding": {"x": x, "y": {**y, "field": "low"}, "y2": {"field": "high"}}}]}
    return Chart("waterfall", "The change, term by term",
                 "From t_iter before to t_iter after, each term's change stacked on the last "
                 "(red: slower, green: faster; faded: within noise; black line: the change's "
                 "95 % interval).", spec)


def changes(cid: str, title: str, d: dict[str, Any], what: str) -> Chart | None:
    """A matched table's top changes as bars with their 95 % intervals, and the table."""
    top = d["top"]
    if not top:
        return None
    names = [r["name"] for r in top]
    data, flat = _columns(
        name=names, change=[_v(r["change"]) for r in top],
        low=[_v(r.get("low")) for r in top], high=[_v(r.get("high")) for r in top],
        before=[_v(r["time_s_before"]) for r in top], after=[_v(r["time_s_after"]) for r in top],
        beyond=[bool(r.get("beyond_noise")) for r in top],
        side=["slower" if r["change"] > 0 else "faster" for r in top])
    y = {"field": "name", "type": "nominal", "sort": names, "title": what,
         "axis": {"labelLimit": 260}}
    x = {"field": "change", "type": "quantitative", "title": "change, ms per iteration"}
    spec = {"width": WIDTH - 280, "height": {"step": 20}, "data": data, "transform": flat,
            "layer": [
                {"mark": {"type": "bar"},
                 "encoding": {"y": y, "x": x,
                              "color": _colour("side", ("slower", "faster"), (SLOWER, FASTER),
                                               "bottom"),
                              "opacity": {"condition": {"test": "datum.beyond", "value": 1},
                                          "value": 0.3},
                              "tooltip": [{"field": "name"},
                                          {"field": "before", "format": ".3f",
                                           "title": "before (ms)"},
                                          {"field": "after", "format": ".3f",
                                           "title": "after (ms)"},
                                          {"field": "change", "format": "+.3f",
                                           "title": "change (ms)"},
                                          {"field": "low", "format": ".3f"},
                                          {"field": "high", "format": ".3f"}]}},
                {"transform": [{"filter": "isValid(datum.low)"}],
                 "mark": {"type": "rule", "color": "black"},
                 "encoding": {"y": y, "x": {**x, "field": "low"}, "x2": {"field": "high"}}}]}
    rows = "".join(
        f"<tr><td>{html.escape(r['name'])}</td><td>{_ms(r['time_s_before'])}</td>"
        f"<td>{_ms(r['time_s_after'])}</td><td>{_ms(r['change'], True)}</td>"
        f"<td>{_ci(r)}</td><td>{_noise(r)}</td></tr>" for r in top)
    table = (f'<table class="changes" data-table="{cid}"><tr><th>{html.escape(what)}</th>'
             "<th>before</th><th>after</th><th>change</th><th>95 % interval</th><th></th></tr>"
             f"{rows}</table>")
    only = [f"<p class=\"caption\">only {side}: {html.escape(', '.join(d[f'only_{side}']))}</p>"
            for side in RUNS if d[f"only_{side}"]]
    return Chart(cid, title, "The largest changes first (faded: within noise or no interval; "
                 "black line: the 95 % interval of the change).", spec, table + "".join(only))


def _noise(r: dict[str, Any]) -> str:
    if r.get("low") is None:
        return ""
    return "beyond noise" if r["beyond_noise"] else "within noise"


def shown_run(doc: dict[str, Any], side: str) -> str:
    """' of run 2 of 3 (a-2.arrow, the side's median)': which of a side's several runs
    its timeline draws ('' with one run a side)."""
    from gputrace.analyzers.compare.diff_runs import median_run

    t = (doc.get("noise") or {}).get("t_iter_runs") or {}
    if len(t.get(side) or []) < 2:
        return ""
    k = median_run(t[side])
    name = (doc.get("runs") or {}).get(side) or []
    what = f"{name[k]}, " if len(name) == len(t[side]) else ""
    return f" of run {k + 1} of {len(t[side])} ({what}the side's median)"


def runs(doc: dict[str, Any]) -> Chart | None:
    """Each run's mean iteration, a dot a run, beside its side's mean (a tick): the spread
    of the dots is the drift between runs that the intervals hold (several runs a side)."""
    t = (doc.get("noise") or {}).get("t_iter_runs") or {}
    if not t or max(len(t.get(side) or []) for side in RUNS) < 2:
        return None
    names = doc.get("runs") or {}
    rows = [(side, k + 1, (names.get(side) or [""] * len(t[side]))[k], _v(v))
            for side in RUNS for k, v in enumerate(t[side])]
    data, flat = _columns(run=[x[0] for x in rows], number=[x[1] for x in rows],
                          trace=[x[2] for x in rows], t_iter=[x[3] for x in rows])
    bt = doc["breakdown"]["t_iter"]
    mdata, mflat = _columns(run=list(RUNS), mean=[_v(bt[side]) for side in RUNS])
    y = {"field": "run", "type": "nominal", "sort": list(RUNS), "title": None}
    x = {"field": "t_iter", "type": "quantitative", "title": "mean iteration, ms",
         "scale": {"zero": False}}
    spec = {"width": WIDTH - 160, "height": {"step": 42}, "layer": [
        {"data": data, "transform": flat, "mark": {"type": "point", "filled": True, "size": 70},
         "encoding": {"y": y, "x": x, "color": _colour("run", RUNS, (TOTAL, SLOWER)),
                      "tooltip": [{"field": "run"}, {"field": "number", "title": "run"},
                                  {"field": "trace"},
                                  {"field": "t_iter", "format": ".2f", "title": "t_iter (ms)"}]}},
        {"data": mdata, "transform": mflat,
         "mark": {"type": "tick", "color": "black", "thickness": 2},
         "encoding": {"y": y, "x": {**x, "field": "mean"},
                      "tooltip": [{"field": "run"}, {"field": "mean", "format": ".2f",
                                                     "title": "the runs' mean (ms)"}]}}]}
    n = {side: len(t[side]) for side in RUNS}
    return Chart("runs", "Each run's mean iteration",
                 f"{n['before']} runs before, {n['after']} after: a dot per run, the side's "
                 "mean (black tick) the figure compared; the spread of the dots is the drift "
                 "between runs that every interval holds.", spec)


def timelines(before: RankAnalysis, after: RankAnalysis, doc: dict[str, Any] | None = None,
              one: bool = False) -> list[Chart]:
    """Each run's representative (median-length) iteration, one above the other; with
    several runs a side, the side's median run's (`before`, `after`), named in the title."""
    out = []
    ends = [0.0]
    for ra in (before, after):
        tl = ra.detail.timeline if ra.detail is not None else None
        if tl is not None:
            ends += [tl.t_iter_s, *(b.end_s for b in tl.bars)]
    domain = [0, round(max(ends) * 1e3 * 1.02, 3)]
    for run, ra in zip(RUNS, (before, after), strict=True):
        c = timeline(ra, one)
        if c is None:
            continue
        spec = copy.deepcopy(c.spec)    # both on one scale: the longer iteration's
        spec["layer"][0]["encoding"]["x"]["scale"] = {"domain": domain}
        which = shown_run(doc, run) if doc is not None else ""
        out.append(replace(c, id=f"timeline-{run}", spec=spec, title=c.title.replace(
            "One iteration", f"One iteration {run}{which},")))
    return out


def charts(doc: dict[str, Any], before: RankAnalysis, after: RankAnalysis,
           one: bool = False) -> list[Chart]:
    """Every chart of the diff page the runs have data for, in page order (`one`: each run
    one process, no rank to name)."""
    layers, units = doc["layers"], doc["units"]
    made = (runs(doc), breakdowns(doc), waterfall(doc),
            changes("layers-backward", "Layers, backward: top changes", layers["backward"],
                    "layer"),
            changes("layers-forward", "Layers, forward: top changes", layers["forward"],
                    "layer"),
            changes("units", "Comm units: top changes", units, "unit"),
            *timelines(before, after, doc, one))
    return [c for c in made if c is not None]
