"""The report's charts as Vega-Lite specifications (plain JSON), built from an Analysis.

Vega-Lite draws, stacks, scales, zooms and shows tooltips; this module only chooses the data
and the encodings. Long tables are sent column-wise and expanded by Vega-Lite's `flatten`
transform, so the page carries each value once, not a key per value.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gputrace.analyzers import Analysis, RankAnalysis
from gputrace.report.chart_kit import (  # noqa: F401 - handed on: the charts' one kit
    PALETTE,
    WIDTH,
    Chart,
    _colour,
    _columns,
    _ms,
    _rule,
)
from gputrace.report.charts_comm import unit_bars
from gputrace.report.charts_goodput import goodput_chart
from gputrace.report.charts_parallel import pipeline, tensor_parallel
from gputrace.report.charts_scaling import speedup, what_if
from gputrace.report.solo import one_process

# the breakdown's stack, bottom to top: (term, label, colour key)
STACK = (("t_io", "t_io", "io"), ("t_h2d", "t_h2d", "h2d"), ("t_f", "t_f", "forward"),
         ("t_b", "t_b", "backward"), ("t_u", "t_u", "update"),
         ("exposed", "exposed comm", "comm exposed"), ("t_framework", "framework", "framework"),
         ("t_other", "other", "other"))


def _fade_warmup() -> dict[str, Any]:
    return {"condition": {"test": "datum.warmup", "value": 0.35}, "value": 1}


def breakdown(ra: RankAnalysis, one: bool = False) -> Chart | None:
    d = ra.detail
    if d is None or not d.series.step.size:
        return None
    s = d.series
    n = s.step.size
    parts = {"exposed": s.comm_exposed_s, **{k: s.terms[k] for k, _, _ in STACK if k in s.terms}}
    # framework time (Keras's per-step work) only where the run has any, as in the terminal
    stack = [t for t in STACK if t[0] in parts
             and (t[0] != "t_framework" or float(np.nansum(parts[t[0]])) > 0)]
    terms, its, ms, order = [], [], [], []
    for j, (key, label, _) in enumerate(stack):
        terms += [label] * n
        its += range(n)
        ms += _ms(parts[key])
        order += [j] * n
    data, flat = _columns(term=terms, iteration=its, ms=ms, order=order,
                          step=[int(x) for x in s.step] * len(stack),
                          warmup=[k < s.warmup for k in range(n)] * len(stack))
    tdata, tflat = _columns(iteration=range(n), t_iter=_ms(s.terms["t_iter"]),
                            step=[int(x) for x in s.step])
    x = {"field": "iteration", "type": "ordinal",
         "title": f"iteration (the first {s.warmup} faded: warm-up, left out of the means)"
         if s.warmup else "iteration", "axis": {"labelOverlap": True}}
    labels = [label for _, label, _ in stack]
    y: dict[str, Any] = {"field": "ms", "type": "quantitative", "stack": "zero",
                         "title": "ms per iteration"}
    # a slow first iteration would flatten the rest: the axis fits the analyzed ones
    total = np.maximum(s.terms["t_iter"], sum(np.nan_to_num(parts[k]) for k, _, _ in stack))
    top = float(np.max(total[s.warmup:])) if n > s.warmup else 0.0
    if top > 0 and float(np.max(total)) > 1.25 * top:
        y["scale"] = {"domain": [0, round(top * 1.15e3, 3)]}
    spec = {
        "width": WIDTH, "height": 280,
        "layer": [
            {"data": data, "transform": flat, "mark": {"type": "bar", "clip": True},
             "encoding": {
                 "x": x, "y": y,
                 "color": _colour("term", labels, [PALETTE[c] for _, _, c in stack]),
                 "order": {"field": "order", "type": "quantitative"},
                 "opacity": _fade_warmup(),
                 "tooltip": [{"field": "iteration", "type": "ordinal"},
                             {"field": "step", "type": "ordinal"},
                             {"field": "term", "type": "nominal"},
                             {"field": "ms", "type": "quantitative", "format": ".2f"}]}},
            {"data": tdata, "transform": tflat,
             "mark": {"type": "tick", "color": "black", "thickness": 2, "clip": True},
             "encoding": {"x": x, "y": {**y, "field": "t_iter", "stack": None},
                          "tooltip": [{"field": "iteration", "type": "ordinal"},
                                      {"field": "t_iter", "type": "quantitative",
                                       "format": ".2f", "title": "t_iter (ms)"}]}},
        ],
    }
    return Chart("breakdown", "Where each iteration's time goes"
                 + ("" if one else f" (rank {ra.rank})"),
                 "Stacked per iteration like the paper's Table V, black tick = measured t_iter "
                 "(the axis fits the analyzed iterations; a slower warm-up bar is cut): look "
                 "for the tallest colour and for iterations that stand out.",
                 spec)


def timeline(ra: RankAnalysis, one: bool = False) -> Chart | None:
    d = ra.detail
    tl = d.timeline if d is not None else None
    if tl is None or not tl.bars:
        return None
    present = {b.what for b in tl.bars}
    whats = [w for w in PALETTE if w in present] + sorted(present - set(PALETTE))
    data, flat = _columns(
        lane=[b.lane for b in tl.bars], what=[b.what for b in tl.bars],
        start=_ms([b.start_s for b in tl.bars]), end=_ms([b.end_s for b in tl.bars]),
        count=[b.count for b in tl.bars], part=[b.part for b in tl.bars],
        note=[b.note for b in tl.bars])
    colour = _colour("what", whats, [PALETTE.get(w, "#333333") for w in whats], "bottom")
    spec = {
        "width": WIDTH, "height": {"step": 16},
        "data": data,
        "transform": [*flat, {"calculate": "datum.end - datum.start", "as": "ms"}],
        "layer": [
            {"mark": {"type": "bar", "height": {"band": 0.8}},
             "params": [{"name": "zoom", "select": {"type": "interval", "encodings": ["x"]},
                         "bind": "scales"}],
             "encoding": {
                 "y": {"field": "lane", "type": "nominal", "sort": tl.lanes, "title": None,
                       "axis": {"labelLimit": 220}},
                 "x": {"field": "start", "type": "quantitative",
                       "title": "ms from the iteration's start (drag to pan, wheel to zoom)"},
                 "x2": {"field": "end"},
                 "color": colour,
                 "opacity": {"condition": {"test": "datum.part === 'queued'", "value": 0.35},
                             "value": 1},
                 "tooltip": [{"field": "lane"}, {"field": "what"}, {"field": "part"},
                             {"field": "start", "format": ".3f", "title": "start (ms)"},
                             {"field": "ms", "format": ".3f", "title": "duration (ms)"},
                             {"field": "count", "title": "records"}, {"field": "note"}]}},
            _rule("x", tl.t_iter_s * 1e3),
        ],
    }
    step = f" (step {tl.step})" if tl.step >= 0 else ""
    return Chart(
        "timeline", f"One iteration as a timeline: iteration {tl.index}{step}"
        + ("" if one else f", rank {ra.rank}"),
        "The median-length analyzed iteration (dashed line: its end), like the paper's Figs. "
        "6-8: a comm unit is exposed (red) when it ends after the next unit's gradients are "
        "ready, after the backward, or mostly outside compute; its faded part is the wait "
        "from ready to start.", spec)


def rank_heatmap(a: Analysis) -> Chart | None:
    ranks, its, t, steps, warm = [], [], [], [], []
    analyzed: list[np.ndarray] = []
    for r, ra in sorted(a.ranks.items()):
        if ra.detail is None:
            continue
        s = ra.detail.series
        n = s.step.size
        analyzed.append(s.terms["t_iter"][s.warmup:])
        ranks += [r] * n
        its += range(n)
        t += _ms(s.terms["t_iter"])
        steps += [int(x) for x in s.step]
        warm += [k < s.warmup for k in range(n)]
    if not ranks:
        return None
    # against the median analyzed iteration of all ranks: noise stays pale, a straggler
    # stands out whatever the run's spread
    pool = np.concatenate(analyzed)
    median = float(np.median(pool)) * 1e3 if pool.size else 0.0
    rel = [round(v / median, 4) if median > 0 else 1.0 for v in t]
    data, flat = _columns(rank=ranks, iteration=its, t_iter=t, step=steps, warmup=warm,
                          relative=rel)
    nr = len(a.ranks)
    lo = min([0.8, *(v / median * 1e3 for v in pool)]) if median > 0 else 0.8
    hi = max([1.2, *(v / median * 1e3 for v in pool)]) if median > 0 else 1.2
    colour = {"scheme": "blueorange", "domain": [round(lo, 3), 1, round(hi, 3)], "clamp": True}
    spec = {
        "width": WIDTH, "height": {"step": max(3, min(24, 480 // nr))},
        "data": data, "transform": flat, "mark": "rect",
        "encoding": {
            "x": {"field": "iteration", "type": "ordinal", "axis": {"labelOverlap": True}},
            "y": {"field": "rank", "type": "ordinal"},
            "color": {"field": "relative", "type": "quantitative",
                      "title": "t_iter / median", "scale": colour},
            "opacity": _fade_warmup(),
            "tooltip": [{"field": "rank"}, {"field": "iteration"}, {"field": "step"},
                        {"field": "t_iter", "format": ".2f", "title": "t_iter (ms)"},
                        {"field": "relative", "format": ".2f", "title": "t_iter / median"}]},
    }
    return Chart("ranks", "t_iter per rank and iteration",
                 "Colour = t_iter over the median analyzed iteration of all ranks: an orange "
                 "row is a straggler rank, an orange column an iteration slow on every rank "
                 "(faded: warm-up).",
                 spec)


def comm_wait(a: Analysis) -> Chart | None:
    rows = [(r, ra.comm_wait_s, ra.comm_transfer_s) for r, ra in sorted(a.ranks.items())
            if ra.comm_wait_s is not None]
    if not rows:
        return None
    parts = ("waiting for peers", "transferring")
    data, flat = _columns(rank=[r for r, _, _ in rows for _ in parts],
                          part=list(parts) * len(rows),
                          ms=[round(float(v or 0.0) * 1e3, 4) for _, w, x in rows
                              for v in (w, x)])
    spec = {
        "width": WIDTH, "height": {"step": 22}, "data": data, "transform": flat, "mark": "bar",
        "encoding": {
            "y": {"field": "rank", "type": "ordinal"},
            "x": {"field": "ms", "type": "quantitative", "stack": "zero",
                  "title": "ms of comm per iteration"},
            "color": _colour("part", parts, ["#bab0ac", "#4c78a8"], "bottom"),
            "tooltip": [{"field": "rank"}, {"field": "part"},
                        {"field": "ms", "format": ".2f", "title": "ms per iteration"}]},
    }
    return Chart("comm-wait", "Gradient comm per rank: waiting for peers vs transferring",
                 "A unit's transfer starts when the last rank arrives: a rank with much grey "
                 "arrives early and waits for a slower peer.", spec)


def _link_kind(name: str) -> str:
    base = name.split("@")[0]
    if name in ("disk", "cache"):
        return "storage vs page cache"
    return {"pcie": "PCIe", "nvlink": "NVLink", "ib": "InfiniBand", "net": "network"}.get(
        base.split(".")[0], base.split(".")[0])


def bandwidth(ra: RankAnalysis) -> Chart | None:
    d = ra.detail
    if d is None or not d.bandwidth:
        return None
    names: list[str] = []
    kinds: list[str] = []
    t: list[float] = []
    rate: list[float | None] = []
    what: list[str] = []

    def add(name: str, times: list[float], values: list[float | None], label: str) -> None:
        names.extend([name] * len(times))
        kinds.extend([_link_kind(name)] * len(times))
        t.extend(times)
        rate.extend(values)
        what.extend([label] * len(times))

    for ls in d.bandwidth:
        times = [round(float(x), 4) for x in ls.t_s]
        add(ls.name, times, [float(f"{v:.4g}") if math.isfinite(v) else None
                             for v in ls.bytes_per_s], "achieved")
        if ls.peak_bytes_per_s:     # the peak as a second, flat line of the same link
            add(ls.name, [times[0], times[-1]], [ls.peak_bytes_per_s] * 2, "probed peak")
    data, flat = _columns(link=names, kind=kinds, t=t, bytes_per_s=rate, what=what)
    links = [ls.name for ls in d.bandwidth]
    lines = list(dict.fromkeys(what))
    layers: list[dict[str, Any]] = [
        {"mark": {"type": "line", "interpolate": "step-after"},
         "encoding": {"x": {"field": "t", "type": "quantitative",
                            "title": "s from the first iteration's start"},
                      "y": {"field": "bytes_per_s", "type": "quantitative", "title": "bytes/s",
                            "axis": {"format": "~s"}},
                      "color": {"field": "link", "type": "nominal", "sort": links,
                                "legend": {"title": None, "orient": "right"}},
                      "strokeDash": {"field": "what", "type": "nominal", "sort": lines,
                                     "scale": {"domain": lines,
                                               "range": [[1, 0], [6, 4]][:len(lines)]},
                                     "legend": {"title": None, "orient": "right"}
                                     if len(lines) > 1 else None},
                      "tooltip": [{"field": "link"}, {"field": "what"},
                                  {"field": "t", "format": ".2f"},
                                  {"field": "bytes_per_s", "format": "~s"}]}}]
    s = d.series
    if s.warmup and s.warmup < s.start_ns.size:
        at = (int(s.start_ns[s.warmup]) - d.bandwidth_start_ns) / 1e9
        layers.append(_rule("x", at, "#666", (2, 2), in_facet=True))
    kinds_in = list(dict.fromkeys(kinds))
    spec = {"data": data, "transform": flat,
            "facet": {"row": {"field": "kind", "type": "nominal", "sort": kinds_in,
                              "title": None}},
            "spec": {"width": WIDTH - 160, "height": 120, "layer": layers},
            "resolve": {"scale": {"y": "independent"}}}
    peak_note = ("dashed: the peak `gputrace probe` measured" if "probed peak" in lines else
                 "no probed peaks in this trace: run `gputrace probe` once on the host")
    return Chart("bandwidth", "Achieved bandwidth over time",
                 f"One panel per kind of link, each with its own scale ({peak_note}; dotted: "
                 "end of warm-up): look for a link pinned at its peak, or storage reads "
                 "where the page cache should serve them.", spec)


EVIDENCE = {"input_bound": "breakdown", "unattributed": "breakdown", "update_heavy": "breakdown",
            "model_mismatch": "breakdown", "comm_exposed": "timeline", "comm_tail": "timeline",
            "comm_not_overlapped": "timeline", "comm_hidden": "timeline",
            "h2d_pageable": "timeline", "low_bandwidth_": "bandwidth",
            "what_if_buckets": "what-if", "framework_overhead": "breakdown",
            "memory_": "memory", "evaluation_large": "goodput", "checkpoint_large": "goodput",
            "stalls_large": "goodput", "startup_large": "goodput"}


def evidence(finding_id: str) -> str | None:
    if finding_id in EVIDENCE:
        return EVIDENCE[finding_id]
    return next((c for k, c in EVIDENCE.items() if k.endswith("_")
                 and finding_id.startswith(k)), None)


def charts(a: Analysis, ra: RankAnalysis) -> list[Chart]:
    """Every chart the analysis has data for, in page order."""
    one = one_process(a)     # no rank to name
    made = (breakdown(ra, one), goodput_chart(ra, one), timeline(ra, one), unit_bars(ra), pipeline(a, ra), tensor_parallel(ra),
            rank_heatmap(a), comm_wait(a), bandwidth(ra), speedup(ra), what_if(ra))
    return [c for c in made if c is not None]
