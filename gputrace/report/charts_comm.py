"""The report's parts about collectives: a sharded (FSDP) run's per-unit bars (each unit's
all-gather, re-gather and reduce-scatter, exposed vs hidden) and the table of collectives by
kind (colours: charts.PALETTE)."""

from __future__ import annotations

import html

from gputrace.analyzers import RankAnalysis
from gputrace.analyzers.parallel.ddp.timeline_comm import ROLE_WHAT
from gputrace.report.chart_kit import PALETTE, WIDTH, Chart, _colour, _columns
from gputrace.report.collectives import in_model


def _unit_label(unit: int, name: str) -> str:
    return f"unit {unit} {name}" if name else f"unit {unit} (root)"


def unit_bars(ra: RankAnalysis) -> Chart | None:
    """Per FSDP unit, ms per iteration of each of its collectives, exposed and hidden."""
    sh = ra.sharded
    if sh is None or not sh.units:
        return None
    lanes: list[str] = []
    label, what, ms, count, mb = [], [], [], [], []
    for u in sorted(sh.units, key=lambda u: (u.unit, u.start_s)):
        lane = _unit_label(u.unit, u.name)
        if lane not in lanes:
            lanes.append(lane)
        role = ROLE_WHAT.get(u.role, u.role)
        total = u.duration_s * u.count
        exposed = min(max(u.exposed_s, 0.0), total)
        for part, v in (("exposed", exposed), ("hidden", total - exposed)):
            label.append(lane)
            what.append(f"{role} {part}")
            ms.append(round(v * 1e3, 4))
            count.append(round(u.count, 3))
            mb.append(round(u.nbytes / max(u.count, 1e-9) / 1e6, 3))
    present = [w for w in PALETTE if w in {x for x, v in zip(what, ms, strict=True) if v > 0}]
    data, flat = _columns(unit=label, what=what, ms=ms, count=count, mb=mb)
    spec = {
        "width": WIDTH, "height": {"step": 22}, "data": data,
        "transform": [*flat, {"filter": "datum.ms > 0"}], "mark": "bar",
        "encoding": {
            "y": {"field": "unit", "type": "nominal", "sort": lanes, "title": None,
                  "axis": {"labelLimit": 220}},
            "x": {"field": "ms", "type": "quantitative", "stack": "zero",
                  "title": "ms per iteration"},
            "color": _colour("what", present, [PALETTE[w] for w in present], "bottom"),
            "tooltip": [{"field": "unit"}, {"field": "what"},
                        {"field": "ms", "format": ".2f", "title": "ms per iteration"},
                        {"field": "count", "title": "per iteration"},
                        {"field": "mb", "format": ".2f", "title": "MB each"}]},
    }
    ex = sh.exposed
    return Chart(
        "fsdp-units", f"{sh.label} units: exposed vs hidden collectives per unit",
        f"Strong colours: time the unit's compute (all-gather, re-gather) or the step "
        f"(reduce-scatter) stood still for it; pale: time it ran behind compute. Exposed per "
        f"iteration: forward {ex['forward_s'] * 1e3:.1f} ms (Case {sh.cases['forward']}), "
        f"backward {ex['backward_s'] * 1e3:.1f} ms (Case {sh.cases['backward']})."
        + (f" Settings read from the job: {sh.settings.text()}." if sh.settings else ""), spec)


def kinds_table(ra: RankAnalysis) -> list[str]:
    """The HTML section of collectives by kind, when the rank issued any besides DDP's
    gradient buckets."""
    c = ra.collectives
    if not c.kinds or (len(c.kinds) == 1 and c.kinds[0].gradient and ra.sharded is None):
        return []
    e = html.escape
    rows = "".join(
        f'<tr data-kind="{e(k.kind)}"><td>{e(k.kind)}</td><td>'
        + e(in_model(ra, k)) + f"</td><td>{k.count:.3g}</td><td>{k.nbytes / 1e6:.2f}</td>"
        f"<td>{k.bytes_out / 1e6:.2f}</td><td>{k.time_s * 1e3:.1f} ms</td>"
        f"<td>{k.exposed_s * 1e3:.1f} ms</td></tr>" for k in c.kinds)
    groups = ", ".join(str(g) for g in c.group_sizes) or "unknown"
    return ['<section id="collectives"><h2>Collectives by kind (per iteration)</h2>',
            f'<p class="caption">{c.recorded} collectives recorded, {c.in_iterations} in the '
            f"analyzed iterations; process group sizes: {e(groups)}.</p>",
            '<table id="collectives-table"><tr><th>kind</th><th>in the model</th>'
            "<th>count</th><th>MB in</th><th>MB out</th><th>time</th><th>exposed</th></tr>"
            f"{rows}</table></section>"]
