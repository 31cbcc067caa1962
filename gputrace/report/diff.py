"""The terminal view of `gputrace diff`: the headline, then the changes behind it."""

from __future__ import annotations

from typing import IO, Any

from rich.markup import escape
from rich.table import Table

from gputrace.fmt import count, mb
from gputrace.report import console
from gputrace.report.diff_goodput import render_goodput


def _ms(s: float | None, sign: bool = False) -> str:
    if s is None:
        return "-"
    v = s * 1e3
    digits = 1 if abs(v) >= 1 or v == 0 else 2   # a change of 40 us is not "+0.0 ms"
    return f"{v:+.{digits}f} ms" if sign else f"{v:.{digits}f} ms"


def _ci(r: dict[str, Any]) -> str:
    if r["low"] is None:
        return "no interval"
    return f"[{r['low'] * 1e3:+.1f}, {r['high'] * 1e3:+.1f}]"


def headline(doc: dict[str, Any]) -> str:
    h = doc["headline"]
    pct = f" ({h['change_pct']:+.0f} %)" if h["change_pct"] is not None else ""
    text = (f"t_iter {_ms(h['before'])} -> {_ms(h['after'])}: {_ms(h['change'], True)} "
            f"{_ci(h)}{pct}")
    if h["low"] is None:
        text += ", fewer than 2 iterations on a side: no noise to measure"
    elif not h["beyond_noise"]:
        text += ", within noise"
    ex = h["explained_by"]
    terms = ", ".join(f"{e['label']} {_ms(e['change'], True)}" for e in ex)
    if ex and h["beyond_noise"]:
        text += f": {terms}; the rest within noise"
    elif ex:    # the iteration did not move, its parts did (they offset each other)
        text += f"; its terms beyond noise: {terms}"
    elif h["beyond_noise"]:
        text += "; no single term beyond noise"
    return text


def stalls(doc: dict[str, Any]) -> str:
    """', and their stalls (3.1 ms per iteration before, 0.0 ms after) and wait for a CPU
    (...) as noise between runs' where a run has any ('' otherwise)."""
    nz = doc.get("noise") or {}
    said = []
    for key, what in (("excursions_s", "stalls"), ("run_wait_s", "wait for a CPU")):
        v = nz.get(key) or {}
        if any(v.get(k) for k in ("before", "after")):
            said.append(f"{what} ({_ms(v.get('before'))} per iteration before, "
                        f"{_ms(v.get('after'))} after)")
    return f", and their {' and '.join(said)} as noise between runs" if said else ""


def method(doc: dict[str, Any]) -> str:
    """How the intervals were made: '95 % intervals by bootstrap resampling ...' with one
    run a side, '95 % intervals across the runs ...' with several."""
    nz = doc.get("noise") or {}
    runs = nz.get("runs") or {"before": 1, "after": 1}
    if nz.get("drift_in_interval"):
        how = ("Student's t on the differences of the runs made in pairs" if nz.get("paired")
               else "Welch's t on their means")
        return (f"{runs['before']} runs before, {runs['after']} after; 95 % intervals across "
                f"the runs ({how}): the drift between runs is in them")
    return ("95 % intervals by bootstrap resampling of each run's iterations" + stalls(doc))


def drift_line(doc: dict[str, Any]) -> str:
    """With one run a side: the line saying the drift between runs is not in the intervals
    and how many runs a side put it there ('' with several)."""
    nz = doc.get("noise") or {}
    if nz.get("drift_in_interval") or "runs_for_drift" not in nz:
        return ""
    n = nz["runs_for_drift"]
    return (f"One run a side: the drift between runs of the same code is not in these "
            f"intervals; {n} runs a side, interleaved, put it there (gputrace record --repeat "
            f"{n}, then gputrace diff A1 A2 A3 -- B1 B2 B3)")


def only_line(doc: dict[str, Any]) -> str:
    """'Terms only one run has: before: comm (all of it); after: waiting for data (I/O)'
    ('' when both have the same)."""
    only = doc.get("terms_only") or {}
    parts = [f"{side}: {', '.join(doc['breakdown'][k]['label'] for k in only[side])}"
             for side in ("before", "after") if only.get(side)]
    return f"Terms only one run has time in: {'; '.join(parts)}" if parts else ""


def render(doc: dict[str, Any], file: IO[str] | None = None) -> None:
    con = console(file)
    con.print(escape(headline(doc)))
    it = doc["iterations"]
    con.print(f"{count(it['before'], 'iteration')} analyzed before, {it['after']} after; "
              + method(doc))
    if drift_line(doc):
        con.print(escape(drift_line(doc)))
    if doc["not_comparable"]:
        con.print(escape(f"Not comparable: {doc['not_comparable']}; what matches is "
                         "compared below"))
    t = Table(title="Where an iteration's time goes, before and after (mean)",
              title_justify="left", box=None)
    for c in ("term", "", "before", "after", "change", "95 % interval", ""):
        t.add_column(c, justify="left" if c in ("term", "") else "right")
    for k, r in doc["breakdown"].items():
        t.add_row(k, r["label"], _ms(r["before"]), _ms(r["after"]), _ms(r["change"], True),
                  _ci(r), "" if r["low"] is None else
                  "beyond noise" if r["beyond_noise"] else "within noise")
    con.print(t)
    only = only_line(doc)
    if only:
        con.print(escape(only))
    for k, v in (doc.get("throughput") or {}).items():
        con.print(f"the job's {k.replace('_per_s', '')}/s: {v['before']:,.1f} -> "
                  f"{v['after']:,.1f}" + (f" ({v['ratio']:.3g}x)" if v["ratio"] else ""))
    for ph in ("forward", "backward"):
        _named(con, f"Layers, {ph} (per iteration)", doc["layers"][ph], "layer")
    _named(con, "Comm units (per iteration)", doc["units"], "unit")
    _named(con, "Collectives by kind", doc["collectives"], "kind", count=True, nbytes=True)
    _named(con, "GPU kernels (per iteration)", doc["kernels"], "kernel", count=True)
    _ranks(con, doc["ranks"])
    if not _one_process_without_comm(doc):
        _model(con, doc["model"])
    _made(con, doc["made"])
    render_goodput(con, doc)


def _named(con: Any, title: str, d: dict[str, Any], what: str, count: bool = False,
           nbytes: bool = False) -> None:
    if not d["top"] and not d["only_before"] and not d["only_after"]:
        return
    t = Table(title=f"{title}: top changes", title_justify="left", box=None)
    cols = [what, "before", "after", "change"]
    ci = any(r.get("low") is not None for r in d["top"])
    if ci:
        cols += ["95 % interval", ""]
    if count:
        cols += ["count before", "count after"]
    if nbytes:
        cols += ["bytes before", "bytes after"]
    for c in cols:
        t.add_column(c, justify="left" if c in (what, "") else "right")
    for r in d["top"]:
        row = [escape(_short(r["name"])), _ms(r["time_s_before"]), _ms(r["time_s_after"]),
               _ms(r["change"], True)]
        if ci:
            row += [_ci(r), "" if r.get("low") is None else
                    "beyond noise" if r["beyond_noise"] else "within noise"]
        if count:
            row += [f"{r['count_before']:g}", f"{r['count_after']:g}"]
        if nbytes:
            row += [mb(r["bytes_before"]), mb(r["bytes_after"])]
        t.add_row(*row)
    con.print(t)
    for side in ("before", "after"):
        names = d[f"only_{side}"]
        if names:
            more = f" (+{len(names) - 10} more)" if len(names) > 10 else ""
            con.print(escape(f"  only {side}: {', '.join(map(_short, names[:10]))}{more}"))


def _short(name: str, most: int = 80) -> str:
    """A kernel's name as a table can hold it (C++ templates run to hundreds of characters)."""
    return name if len(name) <= most else name[: most - 3] + "..."


def _ranks(con: Any, d: dict[str, Any]) -> None:
    if d["matched"] < 2 and not d["only_before"] and not d["only_after"]:
        return
    con.print(f"Slowest rank: {d['slowest_before']} before, {d['slowest_after']} after")
    for k, what in (("stragglers_appeared", "appeared"), ("stragglers_gone", "went away")):
        if d[k]:
            con.print(f"  stragglers that {what}: {', '.join(map(str, d[k]))}")
    _named(con, "Ranks, t_iter", d, "rank")


def _one_process_without_comm(doc: dict[str, Any]) -> bool:
    """Both runs one process with no communication: their models' t_iter is the sum of the
    phases the table gives (eq. 1), and their speedups are not computed."""
    rk, units, t_comm = doc["ranks"], doc["units"], doc["breakdown"].get("t_comm")
    return (rk["matched"] == 1 and not rk["only_before"] and not rk["only_after"]
            and not units["matched"] and not units["only_before"] and not units["only_after"]
            and (t_comm is None or not (t_comm["before"] or t_comm["after"]))
            and not any(v is not None for side in ("before", "after")
                        for v in doc["model"][side]["speedup"].values()))


def _model(con: Any, d: dict[str, Any]) -> None:
    con.print("Model, before -> after")
    b, a = d["before"], d["after"]
    case = "" if b["case"] is None and a["case"] is None else \
        f", Case {b['case']} -> {a['case']}"
    con.print(f"  {b['strategy']} -> {a['strategy']}{case}; predicted t_iter "
              f"{_ms(b['predicted_t_iter'])} -> {_ms(a['predicted_t_iter'])}")
    pts = [g for g in b["speedup"] if b["speedup"][g] is not None
           or a["speedup"].get(g) is not None]
    if pts:
        con.print("  speedup: " + ", ".join(
            f"{g} GPUs {_x(b['speedup'].get(g))} -> {_x(a['speedup'].get(g))}" for g in pts))


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _made(con: Any, d: dict[str, Any]) -> None:
    if not d:
        con.print("How the runs were made: no difference in their metadata")
        return
    con.print("How the runs were made, where they differ (before -> after)")
    for k, v in d.items():
        if isinstance(v, dict):
            for n, (vb, va) in v.items():
                con.print(escape(f"  {k}.{n}: {vb!r} -> {va!r}"))
        else:
            con.print(escape(f"  {k}: {v[0]!r} -> {v[1]!r}"))
