"""SQL over a trace with DuckDB, as Nsight Systems users query its SQLite export.

    from gputrace import sql
    con = sql.connect("run.arrow")            # one file, a multi-node recording, shards
    con.sql(sql.QUERIES["top_kernels"]).df()  # or any SQL over the views below

A connection holds the trace's rows (trace format v1, DESIGN.md; the Arrow table registered
as `trace_rows`, scanned in place, not copied) as the view `events`, and views over it
(times in ns on the trace clock, durations also in seconds):

  events      every row, plus `dur_ns` (end_ns - start_ns; null for samples and instants)
  spans       events of kind `span`, plus `dur_s`
  samples     events of kind `sample`
  iterations  rank, host, step, start_ns, end_ns, dur_s of each iteration
  comm        comm spans, plus `comm_kind` (args.kind, else read from the name: all_reduce,
              all_gather, reduce_scatter, broadcast, all_to_all, send_recv, barrier),
              `group_name`, `group_size` (args.group), `phase_issued` (args.phase)
  gpu         kernels, copies and memsets, with the phase of their launch (`phase`)

DuckDB is the `notebook` extra: pip install 'gputrace[notebook]'.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from gputrace.report.tables import need

VIEWS = {
    "spans": "SELECT *, dur_ns / 1e9 AS dur_s FROM events WHERE kind = 'span'",
    "samples": "SELECT * FROM events WHERE kind = 'sample'",
    "iterations": "SELECT rank, host, step, start_ns, end_ns, dur_ns / 1e9 AS dur_s "
                  "FROM events WHERE kind = 'span' AND cat = 'iteration'",
    "comm": """
SELECT *, dur_ns / 1e9 AS dur_s,
  coalesce(CASE WHEN json_valid(args) THEN json_extract_string(args, '$.kind') END,
    CASE
      WHEN regexp_matches(lower(name), 'all_?reduce') THEN 'all_reduce'
      WHEN regexp_matches(lower(name), 'all_?gather') THEN 'all_gather'
      WHEN regexp_matches(lower(name), 'reduce_?scatter') THEN 'reduce_scatter'
      WHEN regexp_matches(lower(name), 'broadcast') THEN 'broadcast'
      WHEN regexp_matches(lower(name), 'all_?to_?all') THEN 'all_to_all'
      WHEN regexp_matches(lower(name), 'send|recv') THEN 'send_recv'
      WHEN regexp_matches(lower(name), 'barrier') THEN 'barrier'
      ELSE name END) AS comm_kind,
  CASE WHEN json_valid(args) THEN json_extract_string(args, '$.group.name') END AS group_name,
  CASE WHEN json_valid(args) THEN TRY_CAST(json_extract(args, '$.group.size') AS INTEGER)
       END AS group_size,
  CASE WHEN json_valid(args) THEN json_extract_string(args, '$.phase') END AS phase_issued
FROM events WHERE kind = 'span' AND cat = 'comm'""",
    "gpu": "SELECT *, dur_ns / 1e9 AS dur_s FROM events "
           "WHERE kind = 'span' AND cat IN ('kernel', 'memcpy', 'memset')",
}

QUERIES = {
    # the five GPU kernels (or copies) that take the most time in each phase of their launch
    "top_kernels": """
SELECT phase, name, calls, total_s, mean_us FROM (
  SELECT coalesce(phase, 'none') AS phase, name, count(*) AS calls,
         sum(dur_ns) / 1e9 AS total_s, avg(dur_ns) / 1e3 AS mean_us,
         row_number() OVER (PARTITION BY coalesce(phase, 'none')
                            ORDER BY sum(dur_ns) DESC, name) AS place
  FROM gpu GROUP BY 1, 2)
WHERE place <= 5 ORDER BY phase, total_s DESC, name""",
    # communication per collective kind and process group
    "comm_by_kind": """
SELECT comm_kind, group_name, count(*) AS calls, sum(bytes) AS bytes,
       sum(dur_ns) / 1e9 AS total_s, avg(dur_ns) / 1e3 AS mean_us
FROM comm GROUP BY ALL ORDER BY total_s DESC, comm_kind, group_name""",
    # iterations at least 20 % slower than the median iteration of their rank
    "slow_iterations": """
SELECT rank, step, dur_s, dur_s / median_s AS over_median FROM (
  SELECT rank, step, dur_s, median(dur_s) OVER (PARTITION BY rank) AS median_s
  FROM iterations)
WHERE dur_s > 1.2 * median_s ORDER BY over_median DESC, rank, step""",
}


def table(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> Any:
    """The trace's rows as one Arrow table (imports of Kineto JSON / nsys SQLite made on the
    fly); bad input raises api.AnalysisError with the command line's one line."""
    from gputrace.analysis.inputs import load_inputs

    single = isinstance(paths, (str, os.PathLike))
    names = [os.fspath(p) for p in ([paths] if single else paths)]  # type: ignore[list-item]
    return load_inputs(names).table


def connect(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
            con: Any = None) -> Any:
    """A DuckDB connection (a new in-memory one, or `con`) with the trace as `events` and
    the views of this module's docstring."""
    duckdb = need("duckdb", "notebook", "SQL over a trace")
    t = table(paths)
    con = con if con is not None else duckdb.connect()
    con.register("trace_rows", t)      # scanned in place (Arrow), not copied
    con.execute("CREATE OR REPLACE VIEW events AS SELECT *, "
                "CASE WHEN kind = 'span' THEN end_ns - start_ns END AS dur_ns "
                "FROM trace_rows")
    for name, body in VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")
    return con


def query(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], sql: str) -> Any:
    """Run one query (SQL, or the name of one of QUERIES) over a trace: a DuckDB relation
    (`.df()`, `.pl()`, `.fetchall()`, `.arrow()`)."""
    con = connect(paths)
    return con.sql(QUERIES.get(sql, sql))
