"""The HTML report: one self-contained page (Vega, Vega-Lite and vega-embed inline, data
inline), opened from a file with no network and no server.

`render` is pure; `vega_script` gets the JavaScript from vl-convert-python (the `report`
extra), which bundles it in about 2 s, so the bundle is kept in gputrace's cache directory
per vl-convert version."""

from __future__ import annotations

import html
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gputrace.analyzers import Analysis, RankAnalysis
from gputrace.analyzers.extras.goodput import FINDINGS as GOODPUT_FINDINGS
from gputrace.analyzers.extras.goodput import WITHHELD
from gputrace.analyzers.findings.rules import Finding
from gputrace.report.charts import Chart, charts, evidence
from gputrace.report.charts_comm import kinds_table
from gputrace.report.checks import withheld
from gputrace.report.goodput import goodput_line, no_iteration_in_window
from gputrace.report.solo import ProbeAdvice, iterations_line, shown_links, solo
from gputrace.report.terminal import STRATEGY, headline, phase_rows

VEGA_LITE = "6.4"      # the Vega-Lite version the specs are written for
INSTALL = "the HTML report needs the report extra: pip install 'gputrace[report]'"

NOT_DRAWN = {    # chart id: (what it would show, why it is not drawn)
    "breakdown": ("Time per iteration", "no iterations"),
    "timeline": ("One iteration as a timeline", "no spans in the median iteration"),
    "ranks": ("t_iter per rank and iteration", "no per-iteration figures"),
    "comm-wait": ("Comm per rank, waiting vs transferring",
                  "needs comm units that two or more ranks share"),
    "bandwidth": ("Bandwidth over time", "no byte counters were sampled (`gputrace record` "
                  "samples them; imported traces rarely carry them)"),
    "speedup": ("Speedup vs GPU count", "no measured compute or I/O time to scale"),
    "what-if": ("What if", "nothing to replay: no comm measured and no link bandwidth known "
                "(--link-bandwidth)"),
}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;margin:0 auto;
max-width:1000px;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:17px;margin:28px 0 2px}h3{font-size:15px;margin:14px 0 2px}
.headline{font-size:16px;font-weight:600;margin:6px 0}.meta,.caption{color:#555;margin:2px 0 8px}
nav a{margin-right:12px}table{border-collapse:collapse;margin:6px 0}
td,th{padding:2px 10px;text-align:right}td:nth-child(-n+2),th:nth-child(-n+2){text-align:left}
th{border-bottom:1px solid #ccc;font-weight:600}
.findings li{margin:4px 0}.sev{display:inline-block;min-width:70px;font-weight:600}
.sev-high{color:#c0392b}.sev-moderate{color:#b7791f}.sev-info{color:#2c7a7b}
.vis{min-height:40px}.missing{color:#777}
"""

EMBED = """
const specs = %s;
window.gputraceViews = {};
const opts = {mode: "vega-lite", renderer: "svg", actions: false};
Promise.all(Object.entries(specs).map(([id, spec]) =>
  vegaEmbed("#vis-" + id, spec, opts).then(r => { window.gputraceViews[id] = r.view; })))
  .then(() => { document.body.dataset.rendered = String(Object.keys(specs).length); })
  .catch(e => { document.body.dataset.rendered = "error"; console.error(e); });
"""


class ReportUnavailable(Exception):
    """The plotting extra is not installed."""


def available() -> None:
    """Raise ReportUnavailable (one line saying what to install) without vl-convert."""
    try:
        import vl_convert  # noqa: F401
    except ImportError:
        raise ReportUnavailable(INSTALL) from None


def vega_script() -> str:
    """Vega, Vega-Lite and vega-embed as one script defining `vegaEmbed`."""
    available()
    from importlib.metadata import version

    import vl_convert

    from gputrace.cache import cache_dir

    path = os.path.join(cache_dir(), f"vega-embed-{version('vl-convert-python')}-"
                                     f"vl{VEGA_LITE}.js")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        pass
    try:
        js = vl_convert.javascript_bundle(vl_version=VEGA_LITE)
    except (ValueError, RuntimeError) as e:   # its JavaScript runtime failed
        raise ReportUnavailable(f"vl-convert could not bundle Vega's JavaScript: {e}") from None
    try:   # a cache that cannot be written only costs the next report the bundling again
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(js)
        os.replace(tmp, path)
    except OSError:
        pass
    return js


def _e(text: object) -> str:
    return html.escape(str(text))


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _summary(a: Analysis, ra: RankAnalysis, source: str) -> list[str]:
    from gputrace import __version__

    m, one = ra.model, solo(a, ra)
    out = [f'<p class="headline">{_e(headline(ra))}</p>',
           f'<p class="meta">{_e(source)} &middot; '
           + _e(iterations_line(a, ra)).replace("; ", " &middot; ", 1)
           + f" &middot; gputrace {_e(__version__)}</p>"]
    if ra.left_out_line:
        out.append(f'<p class="meta">{_e(ra.left_out_line)}</p>')
    held = withheld(a, ra)
    if held:
        out.append('<ul class="withheld">' + "".join(
            f"<li><b>withheld</b>: {_e(fig)}: {_e(why)}</li>" for fig, why in held) + "</ul>")
    strategy = STRATEGY.get(m.strategy, m.strategy) if ra.comm["total_s"] > 0 else \
        "single process, no gradient comm"
    case = f", Case {m.case}" + (f" (C = {m.C})" if m.C is not None else "") if m.case else ""
    # one process: eq. 1 is the sum of the phases below, its +0.0 % says nothing
    said = "." if one and abs(m.relative_error) < 5e-4 else \
        (f"; eq. {_e(m.equation)} predicts {_ms(m.predicted_t_iter)} per iteration against "
         f"{_ms(m.measured_t_iter)} measured ({m.relative_error:+.1%}).")
    out.append(f"<p>Model: {_e(strategy)}{_e(case)}{said}</p>")
    rows = "".join(f"<tr><td>{k}</td><td>{_e(label)}</td><td>{_ms(ra.breakdown[k].mean)}</td>"
                   f"<td>{_ms(ra.breakdown[k].std)}</td></tr>"
                   + (_recompute_row(ra) if k == "t_b" else "")
                   for k, label in (("t_iter", "iteration"), *phase_rows(ra))
                   if not (one and k == "t_comm"))
    out.append("<table><tr><th>term</th><th></th><th>mean</th><th>&plusmn; std</th></tr>"
               f"{rows}</table>")
    return out


def _recompute_row(ra: RankAnalysis) -> str:
    """The breakdown's row under t_b: the forward activation checkpointing recomputed in
    it, where there is one."""
    rc = ra.recompute
    if rc is None or not rc.mean_s:
        return ""
    of = f", {rc.share_of_t_b:.0%} of t_b" if rc.share_of_t_b is not None else ""
    return (f'<tr class="recompute"><td></td><td>&nbsp;&nbsp;of which recompute '
            f"(checkpointed forward{of})</td><td>{_ms(rc.mean_s)}</td>"
            f"<td>{_ms(rc.std_s or 0.0)}</td></tr>")


def _findings(ra: RankAnalysis, drawn: dict[str, Chart], more: Sequence[Finding] = ()
              ) -> list[str]:
    items = []
    for f in (*ra.findings, *more):
        target = evidence(f.id)
        link = (f' &mdash; evidence: <a href="#{target}">{_e(drawn[target].title)}</a>'
                if target in drawn else "")
        items.append(f'<li data-finding="{_e(f.id)}"><span class="sev sev-{_e(f.severity)}">'
                     f"{_e(f.severity)}</span> {_e(f.message)}{link}</li>")
    if not items:
        items.append("<li>No findings: nothing stands out.</li>")
    return ['<h2 id="findings">Findings</h2>', f'<ul class="findings">{"".join(items)}</ul>']


def _parallel_not_drawn(ra: RankAnalysis) -> list[tuple[str, str, str]]:
    """The parallel sections a run's dimensions call for, with why each would be missing."""
    out = []
    if "pp" in ra.degrees:
        out.append(("pipeline", "Pipeline: one iteration, stage by stage",
                    "no pipeline spans of every stage in one analyzed iteration (each stage "
                    "recorded by gputrace's pipelining collector, one stage per rank)"))
    if "tp" in ra.degrees:
        out.append(("tensor-parallel", "Tensor parallel: collectives per layer",
                    "no tensor-parallel collectives in this rank's analyzed iterations"))
    return out


def render(a: Analysis, rank: int | None, script: str, source: str = "",
           more: tuple[Chart, ...] = (), findings: Sequence[Finding] = ()) -> str:
    """The page for one rank (default: the slowest) of an analysis made with detail=True;
    `script` is vega_script()'s; `more`: charts of what the analysis does not hold (a
    windowed run's whole series, memory over one iteration), `findings` the findings of it
    (document.page_parts)."""
    ra = a.ranks[rank] if rank is not None else a.main
    empty = no_iteration_in_window(ra)     # the trace as one window: no iteration's figures
    if empty is not None:
        ra = replace(ra, findings=[f for f in ra.findings if f.id in GOODPUT_FINDINGS])
    # without an iteration, the charts over the run's clock only
    made = [c for c in charts(a, ra) if empty is None or c.id in ("goodput", "bandwidth")]
    drawn = {c.id: c for c in (*made, *more)}
    summary = _summary(a, ra, source) if empty is None else [
        f'<p class="headline">{_e(empty)}</p>',
        *([f'<p class="meta">{_e(good)}</p>'] if (good := goodput_line(a, ra)) is not None
          and WITHHELD not in ra.withheld else [])]
    body = ["<h1>gputrace report</h1>", *summary,
            "<nav>" + "".join(f'<a href="#{c.id}">{_e(c.title.split(":")[0])}</a>'
                              for c in drawn.values()) + "</nav>",
            *_findings(ra, drawn, findings), *kinds_table(ra)]
    reasons = {k: why if empty is None else "no training iteration in the recorded window"
               for k, (_, why) in NOT_DRAWN.items()}
    advise = ProbeAdvice()     # the terminal's reasons, word for word, in its order
    if ra.speedup.unavailable and empty is None:
        reasons["speedup"] = advise(ra.speedup.unavailable)
    if ra.replay_unavailable and empty is None:
        reasons["what-if"] = advise(ra.replay_unavailable)
    # then the captions, as the terminal's bandwidth and FLOPs lines (no bandwidth line
    # where no link moved what it can show: the advice is not given there)
    bw_line = ra.bandwidth is not None and bool(shown_links(ra.bandwidth.links))
    for c in drawn.values():
        caption = advise.quiet(c.caption) if c.id == "bandwidth" and not bw_line else \
            advise(c.caption)
        body.append(f'<section id="{c.id}" class="chart"><h2>{_e(c.title)}</h2>'
                    f'<p class="caption">{_e(caption)}</p>'
                    f'<div class="vis" id="vis-{c.id}"></div>{c.extra}</section>')
    missing = [f"<li>{_e(what)}: {_e(reasons[k])}</li>" for k, (what, _) in NOT_DRAWN.items()
               if k not in drawn]
    missing += [f"<li>{_e(what)}: {_e(why)}</li>" for k, what, why in _parallel_not_drawn(ra)
                if k not in drawn]
    if missing:
        body.append(f'<h2>Not drawn</h2><ul class="missing">{"".join(missing)}</ul>')
    title = f"gputrace report: {source}" if source else "gputrace report"
    return page(title, body, {c.id: c.spec for c in drawn.values()}, script)


def page(title: str, body: list[str], specs: dict[str, Any], script: str) -> str:
    """A whole page: `body` (HTML, escaped where it was made), then each spec drawn into
    the element `vis-<id>`, with the Vega bundle `script` inline."""
    data = json.dumps(specs, separators=(",", ":")).replace("</", "<\\/")
    script = script.replace("</script", "<\\/script")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style>\n"
            "<script>/* Vega, Vega-Lite, vega-embed (BSD-3-Clause), bundled by "
            f"vl-convert */\n{script}</script>\n"
            f"</head><body>\n{chr(10).join(body)}\n<script>{EMBED % data}</script>\n"
            "</body></html>\n")


def write(a: Analysis, path: str, rank: int | None = None, source: str = "",
          more: tuple[Chart, ...] = (), findings: Sequence[Finding] = ()) -> int:
    """Write the page; returns its size in bytes."""
    data = render(a, rank, vega_script(), source, more, findings).encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


# -- in a notebook: one chart, or the whole page, as an output cell's HTML ------------------

FRAGMENT = """
(function () {
  const id = %s, spec = %s;
  window.gputraceViews = window.gputraceViews || {};
  vegaEmbed("#vis-" + id, spec, {mode: "vega-lite", renderer: "svg", actions: false})
    .then(r => {
      window.gputraceViews[id] = r.view;
      const n = Object.keys(window.gputraceViews).length;
      if (n >= document.querySelectorAll("section.chart").length)
        document.body.dataset.rendered = String(n);
    })
    .catch(e => { document.body.dataset.rendered = "error"; console.error(e); });
})();
"""


def fragment(chart: Chart, script: str, uid: str) -> str:
    """One chart as an HTML fragment for a notebook's output: a section as on the page, and
    the Vega bundle (`vega_script()`), run only by the first fragment of a page (each output
    carries it, so a saved notebook draws its charts offline whichever outputs it keeps)."""
    spec = json.dumps(chart.spec, separators=(",", ":")).replace("</", "<\\/")
    script = script.replace("</script", "<\\/script")
    return (f'<section id="{_e(uid)}" class="chart gputrace-chart" data-chart="{_e(chart.id)}">'
            f"<h3>{_e(chart.title)}</h3><p>{_e(chart.caption)}</p>"
            f'<div class="vis" id="vis-{_e(uid)}"></div>{chart.extra}</section>\n'
            f"<script>if (!window.vegaEmbed) {{ (function () {{\n{script}\n}})(); }}</script>\n"
            f"<script>{FRAGMENT % (json.dumps(uid), spec)}</script>\n")


def framed(page: str, height: int = 900) -> str:
    """A whole report page inside an iframe (its own document: its styles and scripts stay
    apart from the notebook's)."""
    return (f'<iframe class="gputrace-report" srcdoc="{html.escape(page, quote=True)}" '
            f'style="width:100%;height:{int(height)}px;border:1px solid #ddd" '
            'sandbox="allow-scripts"></iframe>')
