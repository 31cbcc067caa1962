"""The diff as tables (rows of plain values) for DataFrames, built from the `diff --json`
document, so a table and the JSON say the same thing: `breakdown` (every term), and the
matched tables' top changes (`layers` with a `phase` column, `units`, `collectives`,
`kernels`, `ranks`)."""

from __future__ import annotations

from typing import Any

from gputrace.report.tables import Table

TABLES = ("breakdown", "layers", "units", "collectives", "kernels", "ranks")
CHANGE = ("change", "low", "high", "beyond_noise", "between_s")
MATCHED = ("name", "time_s_before", "time_s_after", *CHANGE)


def breakdown(doc: dict[str, Any]) -> Table:
    cols = ("term", "label", "before", "after", "change", "change_pct", "low", "high",
            "beyond_noise", "between_s")
    rows = tuple((k, *(r.get(c) for c in cols[1:])) for k, r in doc["breakdown"].items())
    return Table("breakdown", cols, rows)


def _matched(name: str, groups: list[tuple[dict[str, Any], dict[str, Any]]]) -> Table:
    """The top rows of matched tables, each with the columns `extra` gives it; columns are
    the names first, then every figure a row has, in the order first seen."""
    cols: list[str] = []
    for extra, d in groups:
        for r in d["top"]:
            for c in (*extra, *MATCHED, *r):
                if c not in cols and c not in CHANGE:
                    cols.append(c)
    cols += CHANGE
    if not any(d["top"] for _, d in groups):
        cols = [*groups[0][0], *MATCHED] if groups else list(MATCHED)
    rows = tuple(tuple({**extra, **r}.get(c) for c in cols)
                 for extra, d in groups for r in d["top"])
    return Table(name, tuple(cols), rows)


def table(doc: dict[str, Any], name: str) -> Table:
    """One of TABLES from a diff document."""
    if name not in TABLES:
        raise KeyError(f"no table {name!r}; the tables are {', '.join(TABLES)}")
    if name == "breakdown":
        return breakdown(doc)
    if name == "layers":
        return _matched("layers", [({"phase": ph}, doc["layers"][ph])
                                   for ph in ("forward", "backward")])
    return _matched(name, [({}, doc[name])])
