"""Facts about a trace (for `gputrace info`) and their terminal rendering."""

from __future__ import annotations

from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc

from gputrace.trace.reader import Trace


def trace_info(trace: Trace) -> dict[str, Any]:
    t = trace.table
    md = trace.metadata
    counts: list[dict[str, Any]] = []
    if t.num_rows:
        g = pa.table({
            "kind": t.column("kind").cast(pa.string()),
            "cat": t.column("cat").cast(pa.string()),
            "name": t.column("name").cast(pa.string()),
        }).group_by(["kind", "cat", "name"]).aggregate([([], "count_all")])
        counts = sorted(g.to_pylist(), key=lambda r: (r["kind"], r["cat"], -r["count_all"]))
    start = pc.min(t.column("start_ns")).as_py() if t.num_rows else None
    end_candidates = [pc.max(t.column("start_ns")).as_py() if t.num_rows else None,
                      pc.max(t.column("end_ns")).as_py() if t.num_rows else None]
    end = max((e for e in end_candidates if e is not None), default=None)
    ranks = sorted(r for r in pc.unique(t.column("rank")).to_pylist() if r is not None) \
        if t.num_rows else []
    return {
        "files": trace.sources,
        "format": md.get("format"), "version": md.get("version"),
        "rows": t.num_rows,
        "start_ns": start, "end_ns": end,
        "duration_s": (end - start) / 1e9 if start is not None and end is not None else 0.0,
        "ranks": [r for r in ranks if r >= 0],
        "hosts": md.get("hosts") or ([md["host"]] if md.get("host") else []),
        "argv": md.get("argv"),
        "exit_code": md.get("exit_code"),
        "role": md.get("role"),
        "closed": not (md.get("unclosed") or md.get("recovered_from")),
        "collectors": md.get("collectors", {}),
        "sampler": md.get("sampler"),
        "shards": len(md.get("shards", [])) or 1,
        "env": md.get("env", {}),
        "software": md.get("software", {}),
        "warnings": trace.warnings + list(md.get("recovered", [])),
        "clock_warning": md.get("clock_warning"),
        "probe": _probe_summary(md.get("probe")),
        "extra_columns": [c for c in t.column_names if c not in _v1_names()],
        "counts": counts,
    }


def _exit(info: dict[str, Any]) -> str:
    """The job's exit code, or why the trace has none."""
    if info["exit_code"] is not None:
        return f"exit code: {info['exit_code']}"
    if not info.get("closed", True):
        return "exit code: unknown (the recording was not closed)"
    return {"session": "embedded session (no exit code)",
            "import": "imported (no exit code)"}.get(str(info.get("role")), "exit code: unknown")


def _probe_summary(probe: Any) -> dict[str, Any] | None:
    """Which probe the trace carries and its measured peaks (bytes/s), for `info`."""
    if not isinstance(probe, dict):
        return None
    peaks = {k: v["bytes_per_s"] for k, v in (probe.get("results") or {}).items()
             if isinstance(v, dict) and isinstance(v.get("bytes_per_s"), (int, float))}
    return {"host": probe.get("host"), "created": probe.get("created"),
            "mode": probe.get("mode"), "peaks_bytes_per_s": peaks}


def _v1_names() -> list[str]:
    from gputrace.trace.schema import COLUMN_NAMES

    return COLUMN_NAMES


def render_info(info: dict[str, Any], file: IO[str] | None = None, max_names: int = 40) -> None:
    from rich.markup import escape
    from rich.table import Table

    from gputrace.fmt import count, rate
    from gputrace.report import console

    con = console(file)
    con.print(f"[bold]{', '.join(info['files'])}[/]  {info['format']} v{info['version']}, "
              f"{count(info['rows'], 'row')}, {info['duration_s']:.2f} s, "
              f"{count(info['shards'], 'shard')}")
    con.print(f"hosts: {', '.join(info['hosts']) or '?'}   ranks: "
              f"{', '.join(map(str, info['ranks'])) or 'none'}   {_exit(info)}")
    if info["argv"]:
        con.print(f"command: {escape(' '.join(info['argv']))}")
    if info["sampler"]:
        s = info["sampler"]
        con.print(f"sampler: {s.get('achieved_hz', 0):.1f} Hz achieved of {s.get('hz')} Hz")
    if info.get("probe"):
        p = info["probe"]
        con.print(f"probe: {p['mode']} probe of {p['host']} at {p['created']}: " + ", ".join(
            f"{k} {rate(v)}" for k, v in p["peaks_bytes_per_s"].items()))
    ct = Table(title="collectors", title_justify="left", box=None, padding=(0, 2))
    ct.add_column("collector")
    ct.add_column("status")
    for name, c in sorted(info["collectors"].items()):
        status = c.get("status", "?") if isinstance(c, dict) else str(c)
        ct.add_row(name, "[green]ok[/]" if status == "ok" else escape(status))
    con.print(ct)
    rt = Table(title="rows", title_justify="left", box=None, padding=(0, 2))
    for col in ("kind", "cat", "name"):
        rt.add_column(col)
    rt.add_column("rows", justify="right")
    shown = info["counts"][:max_names]
    for r in shown:
        rt.add_row(r["kind"], r["cat"], escape(r["name"]), f"{r['count_all']:,}")
    if len(info["counts"]) > max_names:
        rest = sum(r["count_all"] for r in info["counts"][max_names:])
        rt.add_row("…", "", f"{len(info['counts']) - max_names} more names", f"{rest:,}")
    con.print(rt)
    for w in info["warnings"]:
        con.print(f"[yellow]warning[/]: {escape(w)}")
    if info["clock_warning"]:
        con.print(f"[yellow]warning[/]: {info['clock_warning']}")
    if info["extra_columns"]:
        con.print(f"extra columns kept: {', '.join(info['extra_columns'])}")
