"""The analysis as tables (rows of plain values) for DataFrames: built from the `analyze
--json` document (report.json.to_dict), so a table and the JSON say the same thing, plus
the per-iteration figures the JSON summarizes (from an analysis made with detail=True).

pandas and polars are optional: `Table.to_pandas()` / `to_polars()` import them when called
and say in one line which extra to install when they are missing."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gputrace.analyzers import Analysis
from gputrace.analyzers.core.steps import TERMS


class MissingExtra(ImportError):
    """An optional dependency a call needs is not installed (one line: what to install)."""


def need(module: str, extra: str, what: str) -> Any:
    """Import an optional module, or raise MissingExtra naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{what} needs {module}: pip install 'gputrace[{extra}]'") from None


@dataclass(frozen=True)
class Table:
    """A named table: its columns in order and its rows (tuples of plain values)."""

    name: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def __len__(self) -> int:
        return len(self.rows)

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]

    def to_arrow(self) -> Any:
        import pyarrow as pa

        return pa.table({c: pa.array(self.column(c)) for c in self.columns}) if self.rows \
            else pa.table({c: pa.array([], pa.null()) for c in self.columns})

    def to_pandas(self) -> Any:
        pd = need("pandas", "notebook", "a DataFrame")
        return pd.DataFrame.from_records(list(self.rows), columns=list(self.columns))

    def to_polars(self) -> Any:
        pl = need("polars", "polars", "a polars DataFrame")
        return pl.from_arrow(self.to_arrow())

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in r)
                       + "</tr>" for r in self.rows)
        return (f'<table class="gputrace-table" data-table="{html.escape(self.name)}">'
                f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")

    def __repr__(self) -> str:
        return f"<gputrace table {self.name}: {len(self.rows)} rows, columns " \
               f"{', '.join(self.columns)}>"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else str(v)


def _table(name: str, records: Sequence[dict[str, Any]], first: Sequence[str] = ()
           ) -> Table:
    """Rows of dicts as a table: `first` columns, then every other key in order of sight."""
    cols: dict[str, None] = dict.fromkeys(first)
    for r in records:
        cols.update(dict.fromkeys(r))
    names = tuple(cols)
    return Table(name, names, tuple(tuple(_plain(r.get(c)) for c in names) for r in records))


def _plain(v: Any) -> Any:
    """Lists (a unit's layers, a finding's evidence) as tuples: hashable, one cell."""
    if isinstance(v, list):
        return tuple(v)
    return v


# the columns of tables whose rows may be none (the keys report.json writes for each row;
# keys it adds later come after these)
UNIT_COLUMNS = ("rank", "index", "layers", "bytes", "ready_s", "start_s", "end_s", "duration_s",
                "hidden", "hidden_fraction")
SCENARIO_COLUMNS = ("label", "gpus", "bandwidth_x", "bucket_rule", "bucket_bytes", "buckets",
                    "comm_s", "exposed_s", "t_iter", "speedup", "t_iter_low", "t_iter_high",
                    "reference_t_iter", "extrapolated")


def breakdown(doc: dict[str, Any]) -> Table:
    """The shown rank's breakdown: one row per term, mean and std over the analyzed
    iterations (seconds), as `breakdown` in the JSON."""
    return Table("breakdown", ("term", "mean", "std"),
                 tuple((k, v["mean"], v["std"]) for k, v in doc["breakdown"].items()))


def units(doc: dict[str, Any]) -> Table:
    """Every rank's comm units (buckets, layers, collectives) with the JSON's keys."""
    return _table("units", [{"rank": int(r), **u} for r, rd in doc["ranks"].items()
                            for u in rd["units"]], UNIT_COLUMNS)


def findings(doc: dict[str, Any]) -> Table:
    return _table("findings", [{"rank": int(r), **f} for r, rd in doc["ranks"].items()
                               for f in rd["findings"]], ("rank", "id", "severity", "message"))


def withheld(doc: dict[str, Any]) -> Table:
    """What the analysis withheld because an invariant did not hold: one row per figure
    (rank None: the run's), with the invariant and why."""
    checks = (doc.get("checks") or {}).get("violated") or []
    return _table("withheld", checks, ("rank", "invariant", "figure", "why"))


RECOMPUTE_COLUMNS = ("rank", "layer", "name", "recompute_s", "std_s", "share_of_t_b",
                     "unavailable")


def recompute(doc: dict[str, Any]) -> Table:
    """Per rank the forward recomputed inside the backward (activation checkpointing), a
    part of t_b, per analyzed iteration (the JSON's `ranks.*.recompute`): a row for the
    whole (layer None: its mean, std and share of t_b, or why it is not known) and one per
    layer recomputed."""
    out: list[dict[str, Any]] = []
    for r, rd in doc["ranks"].items():
        rc = rd.get("recompute")
        if not rc:
            continue
        out.append({"rank": int(r), "layer": None, "name": None, "recompute_s": rc["mean_s"],
                    "std_s": rc["std_s"], "share_of_t_b": rc["share_of_t_b"],
                    "unavailable": rc["unavailable"]})
        out += [{"rank": int(r), **x} for x in rc["layers"]]
    return _table("recompute", out, RECOMPUTE_COLUMNS)


def what_if(doc: dict[str, Any]) -> Table:
    """The shown rank's what-if scenarios (the only rank given intervals), as in the JSON."""
    wi = doc.get("what_if") or {}
    return _table("what_if", wi.get("scenarios") or [], SCENARIO_COLUMNS)


def speedup(doc: dict[str, Any]) -> Table:
    return _table("speedup", doc["speedup"]["points"],
                  ("gpus", "speedup", "efficiency", "t_iter", "t_comm"))


def ranks(doc: dict[str, Any]) -> Table:
    """One row per rank: its breakdown means, comm and I/O overlap, waits, model."""
    out = []
    for r, rd in doc["ranks"].items():
        row: dict[str, Any] = {"rank": int(r), "host": rd.get("host", ""),
                               "slowest": int(r) == doc["slowest_rank"],
                               "iterations": rd["iterations"]["count"],
                               "analyzed": rd["iterations"]["analyzed"]}
        row.update({k: v["mean"] for k, v in rd["breakdown"].items()})
        for what in ("comm", "io"):
            row.update({f"{what}_{k}": v for k, v in rd["overlap"][what].items()})
        row.update(comm_wait_s=rd["comm_wait_s"], comm_transfer_s=rd["comm_transfer_s"],
                   strategy=rd["model"]["strategy"], case=rd["model"]["case"],
                   predicted_t_iter=rd["model"]["predicted_t_iter"],
                   relative_error=rd["model"]["relative_error"])
        out.append(row)
    return _table("ranks", out)


def throughput(doc: dict[str, Any]) -> Table:
    """One row per rank whose batch is known: samples and tokens per iteration and per
    second, the model's forwards per iteration, where the batch came from; and a row `job`
    (rank None): the job's, summed over its data-parallel replicas."""
    cols = ("rank", "samples_per_iteration", "samples_per_s", "tokens_per_sample",
            "tokens_per_s", "forwards_per_iteration", "replicas", "source")
    out = [{"rank": int(r), **{k: v for k, v in rd["throughput"].items() if k in cols}}
           for r, rd in doc["ranks"].items() if rd.get("throughput")]
    job = (doc.get("throughput") or {}).get("job")
    if job:
        out.append({"rank": None, "samples_per_s": job["samples_per_s"],
                    "tokens_per_s": job["tokens_per_s"], "replicas": job["replicas"],
                    "source": "job"})
    return _table("throughput", out, cols)


MEMORY_COLUMNS = ("rank", "host", "phase", "rss_peak_bytes", "cuda_allocated_peak_bytes",
                  "rss_peak_here", "cuda_allocated_peak_here")


def memory(doc: dict[str, Any]) -> Table:
    """Per rank its peaks over the whole run (phase None) and in each phase (the JSON's
    `memory.ranks`), `*_peak_here` true in the phase its peak happened in."""
    out = []
    for r, v in ((doc.get("memory") or {}).get("ranks") or {}).items():
        out.append({"rank": int(r), "host": v.get("host"), "phase": None,
                    "rss_peak_bytes": v.get("rss_peak_bytes"),
                    "cuda_allocated_peak_bytes": v.get("cuda_allocated_peak_bytes")})
        for ph, got in (v.get("phases") or {}).items():
            out.append({"rank": int(r), "host": v.get("host"), "phase": ph, **got,
                        "rss_peak_here": ph == v.get("rss_peak_phase"),
                        "cuda_allocated_peak_here": ph == v.get("cuda_allocated_peak_phase")
                        if v.get("cuda_allocated_peak_phase") else None})
    return _table("memory", out, MEMORY_COLUMNS)


LAYER_COLUMNS = ("layer", "name", "module", "flops_f", "flops_b", "flops_recompute", "t_f_s",
                 "t_b_s", "achieved_flops_per_s_f", "achieved_flops_per_s_b",
                 "achieved_flops_per_s", "share_of_peak", "share_of_iteration")


def layers(doc: dict[str, Any]) -> Table:
    """One row per layer whose FLOPs were counted (the shown rank's, `flops.layers`): its
    forward and backward FLOPs, measured times and achieved FLOP/s; no rows where the trace
    holds no FLOP count."""
    return _table("layers", (doc.get("flops") or {}).get("layers") or [], LAYER_COLUMNS)


def flops(doc: dict[str, Any]) -> Table:
    """One row per rank that counted an iteration's FLOPs: the counts, achieved FLOP/s, MFU
    (and HFU) against the vendor's and the probed peak."""
    out = []
    for r, d in ((doc.get("flops") or {}).get("ranks") or {}).items():
        row = {"rank": int(r), **{k: v for k, v in d.items() if k not in ("mfu", "hfu")}}
        for k in ("mfu", "hfu"):
            row.update({f"{k}_{p}": (d.get(k) or {}).get(p) for p in ("vendor", "probed")})
        out.append(row)
    return _table("flops", out, ("rank", "model_flops_per_iteration",
                                 "hardware_flops_per_iteration", "achieved_flops_per_s",
                                 "mfu_vendor", "mfu_probed", "hfu_vendor", "hfu_probed"))


def iterations(a: Analysis) -> Table:
    """Every iteration of every rank (an analysis made with detail=True): its step, whether
    it is warm-up (left out of the means), whether it is the analyzed iteration whose FLOPs
    were counted (left out of the means too), its start (seconds from the earliest iteration of the
    run) and its terms (seconds), with the comm it left exposed."""
    starts = [int(ra.detail.series.start_ns[0]) for ra in a.ranks.values()
              if ra.detail is not None and ra.detail.series.step.size]
    t0 = min(starts) if starts else 0
    rows = []
    for r, ra in sorted(a.ranks.items()):
        if ra.detail is None:
            continue
        s = ra.detail.series
        for i in range(s.step.size):
            rows.append((r, int(s.step[i]), i < s.warmup, (int(s.start_ns[i]) - t0) / 1e9,
                         *(float(s.terms[k][i]) for k in TERMS), float(s.comm_exposed_s[i]),
                         i == s.left_out))
    # flops_left_out last: the columns before it are as they were (extended, never moved)
    return Table("iterations", ("rank", "step", "warmup", "start_s", *TERMS,
                                "comm_exposed_s", "flops_left_out"), tuple(rows))


GOODPUT_COLUMNS = ("rank", "category", "seconds", "share")


def goodput(doc: dict[str, Any]) -> Table:
    """The whole run (the JSON's `goodput`): per rank, and for the job (rank None: its
    ranks' seconds summed), the training steps' and each badput category's seconds and
    share of the wall time; the rows of a rank sum to its wall time."""
    out: list[dict[str, Any]] = []
    job = (doc.get("goodput") or {}).get("job")
    for r, g in [*((int(r), rd.get("goodput")) for r, rd in doc["ranks"].items()),
                 *([(None, job)] if job and len(doc["ranks"]) > 1 else [])]:
        if not g:
            continue
        out.append({"rank": r, "category": "training", "seconds": g["training_s"],
                    "share": g["goodput"]})
        out += [{"rank": r, "category": k, "seconds": s, "share": g["badput_share"][k]}
                for k, s in g["badput_s"].items()]
    return _table("goodput", out, GOODPUT_COLUMNS)
