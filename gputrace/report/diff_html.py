"""The diff's HTML page (`gputrace report BEFORE AFTER --diff`, `gputrace diff --report`): one
self-contained page, as the report's, made from the `diff --json` document (which it also
carries, in a `<script type="application/json" id="gputrace-diff">`) and, for the two runs'
timelines, from the analyses the document was made of."""

from __future__ import annotations

import json
from typing import Any

from gputrace.analyzers import Analysis
from gputrace.fmt import count
from gputrace.report.charts_diff import _ci, _ms, _noise, charts
from gputrace.report.diff import drift_line, headline, method, only_line
from gputrace.report.html import _e, page, vega_script
from gputrace.report.solo import one_process

NOT_DRAWN = {    # chart id: (what it would show, why it is not drawn)
    "breakdowns": ("Where an iteration's time goes, before and after", "no terms measured"),
    "layers-backward": ("Layers, backward", "no per-layer backward spans in either run"),
    "layers-forward": ("Layers, forward", "no per-layer forward spans in either run"),
    "units": ("Comm units", "no comm unit in either run"),
    "timeline-before": ("One iteration before, as a timeline", "no spans in its median "
                        "iteration"),
    "timeline-after": ("One iteration after, as a timeline", "no spans in its median "
                       "iteration"),
}


def _why_not(doc: dict[str, Any], key: str, why: str) -> str:
    """Why a chart of the rows both runs have is not drawn: rows on one side only are
    named as the terminal's 'Not comparable' line counts them."""
    rows = doc["units"] if key == "units" else \
        doc["layers"].get(key.removeprefix("layers-")) if key.startswith("layers-") else None
    if rows and (rows["only_before"] or rows["only_after"]):
        what = "comm unit" if key == "units" else "layer"
        return (f"no {what} in both runs ({len(rows['only_before'])} only before, "
                f"{len(rows['only_after'])} only after)")
    return why


def _summary(doc: dict[str, Any], before: Analysis, after: Analysis) -> list[str]:
    h = doc["headline"]
    it = doc["iterations"]
    n = (doc.get("noise") or {}).get("runs") or {}
    runs = {k: f"{n[k]} runs, " if n.get(k, 1) > 1 else "" for k in ("before", "after")}
    who = {k: "one process" if one_process(x) else f"rank {doc['rank_' + k]}"
           for k, x in (("before", before), ("after", after))}
    out = [f'<p class="headline" data-verdict="{_e(h["verdict"])}">{_e(headline(doc))}</p>',
           f'<p class="meta">before: {_e(doc["before"])} ({runs["before"]}{who["before"]}, '
           f'{count(it["before"], "iteration")} analyzed) &middot; after: '
           f'{_e(doc["after"])} ({runs["after"]}{who["after"]}, '
           f'{count(it["after"], "iteration")} analyzed) &middot; {_e(method(doc))}</p>']
    if drift_line(doc):
        out.append(f'<p class="drift">{_e(drift_line(doc))}</p>')
    if doc["not_comparable"]:
        out.append(f'<p class="not-comparable">Not comparable: {_e(doc["not_comparable"])}; '
                   "what matches is compared below.</p>")
    ex = h["explained_by"]
    if ex:
        items = "".join(f'<li data-term="{_e(e["term"])}">{_e(e["label"])} '
                        f'{_ms(e["change"], True)}</li>' for e in ex)
        out.append(f'<p>The terms beyond noise, largest first:</p><ul class="explained">'
                   f"{items}</ul>")
    rows = "".join(
        f'<tr data-term="{_e(k)}"><td>{_e(k)}</td><td>{_e(r["label"])}</td>'
        f'<td>{_ms(r["before"])}</td><td>{_ms(r["after"])}</td><td>{_ms(r["change"], True)}'
        f"</td><td>{_ci(r)}</td><td>{_noise(r)}</td></tr>" for k, r in doc["breakdown"].items())
    out.append('<table class="breakdown"><tr><th>term</th><th></th><th>before</th>'
               "<th>after</th><th>change</th><th>95 % interval</th><th></th></tr>"
               f"{rows}</table>")
    if only_line(doc):
        out.append(f'<p class="terms-only">{_e(only_line(doc))}</p>')
    for k, v in (doc.get("throughput") or {}).items():
        ratio = f" ({v['ratio']:.3g}x)" if v["ratio"] else ""
        out.append(f"<p>The job's {_e(k.replace('_per_s', ''))}/s: {v['before']:,.1f} -> "
                   f"{v['after']:,.1f}{ratio}</p>")
    return out


def _made(doc: dict[str, Any]) -> list[str]:
    items = []
    for k, v in doc["made"].items():
        pairs = v.items() if isinstance(v, dict) else [(None, v)]
        for n, (vb, va) in pairs:
            name = k if n is None else f"{k}.{n}"
            items.append(f"<li>{_e(name)}: {_e(repr(vb))} -&gt; {_e(repr(va))}</li>")
    if not items:
        return ['<section id="made"><h2>How the runs were made</h2><p>No difference in '
                "their metadata.</p></section>"]
    return ['<section id="made"><h2>How the runs were made, where they differ</h2>'
            f"<ul>{''.join(items)}</ul></section>"]


def render(doc: dict[str, Any], before: Analysis, after: Analysis, script: str) -> str:
    """The page of a diff document and the analyses it was made of (with their detail);
    `script` is html.vega_script()'s."""
    rb, ra = before.ranks[doc["rank_before"]], after.ranks[doc["rank_after"]]
    drawn = {c.id: c for c in charts(doc, rb, ra, one_process(before) and one_process(after))}
    body = ["<h1>gputrace diff</h1>", *_summary(doc, before, after),
            "<nav>" + "".join(f'<a href="#{c.id}">{_e(c.title.split(":")[0])}</a>'
                              for c in drawn.values()) + "</nav>"]
    for c in drawn.values():
        body.append(f'<section id="{c.id}" class="chart"><h2>{_e(c.title)}</h2>'
                    f'<p class="caption">{_e(c.caption)}</p>'
                    f'<div class="vis" id="vis-{c.id}"></div>{c.extra}</section>')
    body += _made(doc)
    missing = [f"<li>{_e(what)}: {_e(_why_not(doc, k, why))}</li>"
               for k, (what, why) in NOT_DRAWN.items() if k not in drawn]
    if missing:
        body.append(f'<h2>Not drawn</h2><ul class="missing">{"".join(missing)}</ul>')
    data = json.dumps(doc, separators=(",", ":")).replace("</", "<\\/")
    body.append(f'<script type="application/json" id="gputrace-diff">{data}</script>')
    title = f"gputrace diff: {doc['before']} -> {doc['after']}"
    return page(title, body, {c.id: c.spec for c in drawn.values()}, script)


def write(doc: dict[str, Any], before: Analysis, after: Analysis, path: str) -> int:
    """Write the page; returns its size in bytes."""
    data = render(doc, before, after, vega_script()).encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
    return len(data)
