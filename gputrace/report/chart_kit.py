"""The report's chart kit: the page's width and colours, the Chart every chart module
returns, and the small Vega-Lite pieces they share (data sent as columns, a colour
encoding, a rule). The chart modules import it, and report/charts.py, which gathers the
page's charts from them, imports them: no chart module imports charts.py for its kit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

WIDTH = 760

# one colour per phase everywhere on the page
PALETTE = {
    "io": "#f58518", "h2d": "#eeca3b", "forward": "#4c78a8", "backward": "#54a24b",
    "recompute": "#a0d6a0",
    "update": "#b279a2", "comm exposed": "#e45756", "comm hidden": "#72b7b2",
    "other": "#bab0ac", "framework": "#8c6d31", "comm": "#ff9da6", "kernel": "#9d755d", "memcpy": "#79706e",
    "memset": "#d8b5a5", "sync": "#d6d6d6",
    # collectives (charts_comm): strong where the job stood still for them, pale where hidden
    "all-gather exposed": "#d62728", "all-gather hidden": "#ff9896",
    "re-gather exposed": "#9467bd", "re-gather hidden": "#c5b0d5",
    "reduce-scatter exposed": "#8c564b", "reduce-scatter hidden": "#c49c94",
    "HSDP all-reduce exposed": "#e377c2", "HSDP all-reduce hidden": "#f7b6d2",
    "collective exposed": "#e45756", "collective hidden": "#72b7b2",
}


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    caption: str       # one line: what to look for
    spec: dict[str, Any]
    extra: str = ""    # HTML below the chart (its tables), escaped where it is made


def _columns(**cols: Sequence[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Inline data sent as columns, and the transform that makes rows of them."""
    return {"values": [{k: list(v) for k, v in cols.items()}]}, [{"flatten": list(cols)}]


def _ms(x: Any) -> list[float]:
    return [round(float(v) * 1e3, 4) for v in np.asarray(x, dtype=float)]


def _colour(field: str, domain: Sequence[str], colours: Sequence[str],
            orient: str = "right") -> dict[str, Any]:
    """A colour encoding with fixed colours, legend in the domain's order, no title."""
    return {"field": field, "type": "nominal", "sort": list(domain),
            "legend": {"title": None, "orient": orient},
            "scale": {"domain": list(domain), "range": list(colours)}}


def _rule(channel: str, at: float, colour: str = "black", dash: tuple[int, int] = (4, 3),
          in_facet: bool = False) -> dict[str, Any]:
    """A layer with one dashed line at a value: a row of its own (a facet's cells cannot take
    data of their own, so there the cell's rows are aggregated to one)."""
    one: dict[str, Any] = {"transform": [{"aggregate": [{"op": "count", "as": "rows"}]}]} \
        if in_facet else {"data": {"values": [{}]}}
    return {**one, "mark": {"type": "rule", "color": colour, "strokeDash": list(dash)},
            "encoding": {channel: {"datum": round(at, 4)}}}
