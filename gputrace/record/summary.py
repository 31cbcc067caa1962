"""The few lines `record` prints when the job is done: what was recorded, by which source,
and what to run next."""

from __future__ import annotations

import os
from typing import Any

from gputrace.fmt import count

_CAT_SOURCE = {"host": "host", "cpu": "host", "disk": "host", "net": "host", "ib": "infiniband",
               "gpu": "nvml", "pcie": "nvml", "nvlink": "nvml"}


def print_summary(output: str, duration: float, exit_code: int, s: dict[str, Any]) -> None:
    from rich.markup import escape

    from gputrace.report import console

    con = console(stderr=True)
    size = os.path.getsize(output)
    ranks = s["ranks"]
    con.print(f"[bold]gputrace[/]: recorded {duration:.1f} s, exit code {exit_code}, "
              f"{'ranks ' + ', '.join(map(str, ranks)) if ranks else 'not distributed'}, "
              f"{count(s['rows'], 'row')} from {count(s['shards'], 'shard')} "
              f"-> {escape(output)} ({size / 1e6:.2f} MB)")
    rows_by_source: dict[str, int] = {}
    for cat, n in s["rows_by_cat"].items():
        src = _CAT_SOURCE.get(cat, "spans")
        rows_by_source[src] = rows_by_source.get(src, 0) + n
    for name, info in sorted(s["collectors"].items()):
        status = info.get("status", "?") if isinstance(info, dict) else str(info)
        if status == "ok":
            detail = ""
            if name == "host":
                detail = f": {count(rows_by_source.get('host', 0), 'sample')}, " \
                         f"{s['sampler'].get('achieved_hz', 0):.0f} Hz achieved"
            elif name in ("infiniband", "nvml"):
                detail = f": {count(rows_by_source.get(name, 0), 'sample')}"
            con.print(f"  {name:<11} [green]ok[/]{detail}")
        else:
            con.print(f"  {name:<11} [yellow]{escape(status)}[/]")
    con.print(f"  {'spans':<11} {count(rows_by_source.get('spans', 0), 'row')} "
              "(phases, iterations, torch)")
    for w in s["warnings"]:
        con.print(f"[yellow]warning[/]: {escape(w)}")
    if s.get("clock_warning"):
        con.print(f"[yellow]warning[/]: {s['clock_warning']}")
    if s.get("node_of"):
        run = os.path.join(os.path.dirname(output), s["node_of"])
        con.print(f"this node's part of a multi-node run; next, once every node is done: "
                  f"[bold]gputrace analyze {escape(run)}[/] (reads every node's file)")
    else:
        con.print(f"next: [bold]gputrace analyze {escape(s.get('run') or output)}[/]")
