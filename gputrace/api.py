"""Analysis from Python and notebooks: `gputrace.analyze(paths, ...)`.

    import gputrace
    r = gputrace.analyze("run.arrow")
    r.to_dict()                        # == `gputrace analyze run.arrow --json`
    r.to_pandas("iterations")          # a DataFrame per table (pandas; polars: to_polars)
    r.chart("breakdown")               # a chart, drawn inline in Jupyter (offline)
    r.report()                         # the whole HTML report, inline
    d = gputrace.diff("before.arrow", "after.arrow")   # == `gputrace diff ... --json`
    d.to_pandas("layers")              # its tables as DataFrames; d.report(): its page

The result holds the analyzers' own frozen results (`Analysis`, `RankAnalysis`, ...); its
JSON document is made by the one serializer `analyze --json` uses, and its tables are built
from that document, so the three say the same thing.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from gputrace.analysis.run import AnalysisError, AnalysisOptions
from gputrace.analyzers import Analysis, RankAnalysis
from gputrace.analyzers.core.model import ModelResult, Speedup, UnitStats
from gputrace.analyzers.findings.rules import Finding
from gputrace.analyzers.parallel.ddp.replay import Replay, Scenario
from gputrace.report.json_text import dumps, plain
from gputrace.report.tables import MissingExtra, Table
from gputrace.report.tables_diff import TABLES as DIFF_TABLES

__all__ = ["AnalysisError", "AnalysisOptions", "ChartView", "DiffResult", "MissingExtra", "ReportView", "Result",
           "Scenario", "Table", "analyze", "diff"]


TABLES = ("breakdown", "iterations", "units", "ranks", "findings", "speedup", "what_if",
          "throughput", "memory", "layers", "flops", "withheld", "recompute", "goodput",
          # tensor, pipeline and expert parallelism (report.tables_parallel)
          "tp_layers", "tp_what_if", "pipeline_stages", "pipeline_what_if", "expert_parallel")


def analyze(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
            rank: int | None = None, skip: int | None = None,
            gpus: Sequence[int] | str = (2, 4, 8, 16),
            link_bandwidth: float | str | None = None,
            what_if: Sequence[str | Scenario] | str = (), shared_io: bool = False,
            jobs: int | None = None, executor: Executor | None = None, align: bool = True,
            progress: bool | None = None,
            calibrate: str | os.PathLike[str] | None = None,
            batch_size: int | None = None, tokens_per_sample: int | None = None) -> Result:
    """Analyze a trace as `gputrace analyze` does, with the same options.

    `paths`: a trace file, several, a directory of shards, the name of a multi-node
    recording, Kineto JSON or Nsight Systems SQLite. `rank`: the rank shown (default: the
    slowest). `skip`: warm-up iterations left out. `gpus`: GPU counts of the speedup model.
    `link_bandwidth`: bytes/s or text like "7GB/s". `what_if`: replay scenarios, text like
    "gpus=16,bandwidth=2x,bucket_cap_mb=5" or `Scenario`s. `jobs`: processes for the ranks
    (this one and `jobs - 1` workers); `executor`: a concurrent.futures Executor to analyze
    them in instead (e.g. a Dask `Client.get_executor()`). `progress`: draw progress bars (default: on a terminal only).
    `calibrate`: another run of the same pipeline job at another microbatch count, to fit
    the pipeline what-ifs' compute per microbatch (`analyze --calibrate`). `batch_size`,
    `tokens_per_sample`: the throughput's batch where the trace does not tell.
    Raises AnalysisError with the command line's one-line message on bad input."""
    from gputrace import progress as bars
    from gputrace.analysis.run import run_analysis

    single = isinstance(paths, (str, os.PathLike))
    names = [os.fspath(p) for p in ([paths] if single else paths)]  # type: ignore[list-item]
    if not names:
        raise AnalysisError("no trace given")
    opts = AnalysisOptions.of(
        inputs=names, rank=rank, skip=skip, gpus=gpus, link_bandwidth=link_bandwidth,
        what_if=what_if, shared_io=shared_io, jobs=jobs, align=align,
        calibrate=os.fspath(calibrate) if calibrate is not None else None,
        batch_size=batch_size, tokens_per_sample=tokens_per_sample)
    with bars.shown(progress):
        a = run_analysis(opts, detail=True, use=executor)
    return Result(a, rank if rank is not None else a.slowest_rank, " ".join(names),
                  _inputs=tuple(names))


def diff(before: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
         after: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
         rank: int | None = None, skip: int | None = None,
         gpus: Sequence[int] | str = (2, 4, 8, 16), link_bandwidth: float | str | None = None,
         what_if: Sequence[str | Scenario] | str = (), shared_io: bool = False,
         jobs: int | None = None, align: bool = True, progress: bool | None = None
         ) -> DiffResult:
    """Compare two runs as `gputrace diff BEFORE AFTER --json` does, with analyze's options:
    the same document, as a dict (a DiffResult: also its tables, its page and the two
    analyses). `before`, `after`: one run each, or several runs of each side (a list, or a
    glob of runs recorded one after the other): the intervals then hold the drift between
    runs (`diff A1 A2 A3 -- B1 B2 B3`). Raises AnalysisError on bad input."""
    from gputrace import progress as bars
    from gputrace.analysis.run import run_diff

    def side(x: Any) -> str | list[str]:
        return os.fspath(x) if isinstance(x, (str, os.PathLike)) else [os.fspath(p) for p in x]

    opts = AnalysisOptions.of(rank=rank, skip=skip, gpus=gpus,
                              link_bandwidth=link_bandwidth, what_if=what_if,
                              shared_io=shared_io, jobs=jobs, align=align)
    with bars.shown(progress):
        c = run_diff(opts, side(before), side(after))
    return DiffResult(c.doc, before=c.before, after=c.after)


class DiffResult(dict):  # type: ignore[type-arg]
    """The `diff --json` document, as a dict (`d["headline"]`, `json.dumps(d)`), with its
    tables (`table(name)`, `to_pandas(name)`, `to_polars(name)`: TABLES), its HTML
    page (`report()`) and the two analyses it was made of (`before`, `after`)."""

    TABLES = DIFF_TABLES

    def __init__(self, doc: dict[str, Any], before: Analysis, after: Analysis) -> None:
        super().__init__(doc)
        self.before = before
        self.after = after

    def to_dict(self) -> dict[str, Any]:
        """The document as a plain dict (a fresh copy)."""
        return plain(self)

    def table(self, name: str) -> Table:
        """One of TABLES: `breakdown` (every term: before, after, change, its
        interval), `layers` (forward and backward, a `phase` column), `units`,
        `collectives`, `kernels`, `ranks`: the top changes the document holds."""
        from gputrace.report.tables_diff import table

        return table(self, name)

    def to_pandas(self, name: str = "breakdown") -> Any:
        """A table as a pandas DataFrame (the `notebook` extra)."""
        return self.table(name).to_pandas()

    def to_polars(self, name: str = "breakdown") -> Any:
        """A table as a polars DataFrame (polars installed)."""
        return self.table(name).to_polars()

    def report(self, height: int = 900) -> ReportView:
        """The diff's HTML page (as `gputrace report BEFORE AFTER --diff`), inline in
        Jupyter; `.save(path)`."""
        from gputrace.report.diff_html import render
        from gputrace.report.html import vega_script

        return ReportView(render(self, self.before, self.after, vega_script()), height)

    def __reduce__(self) -> Any:      # pickles as the dict it is, with its analyses
        return DiffResult, (dict(self), self.before, self.after)


@dataclass(frozen=True)
class Result:
    """One analysis and the rank it shows (default: the slowest), as `analyze` reports it."""

    analysis: Analysis
    rank: int
    source: str = ""
    _doc: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _inputs: tuple[str, ...] = field(default=(), repr=False, compare=False)

    # -- the analyzers' results for the shown rank ---------------------------------------

    @property
    def shown(self) -> RankAnalysis:
        return self.analysis.ranks[self.rank]

    @property
    def ranks(self) -> dict[int, RankAnalysis]:
        return self.analysis.ranks

    @property
    def world_size(self) -> int:
        return self.analysis.world_size

    @property
    def slowest_rank(self) -> int:
        return self.analysis.slowest_rank

    @property
    def model(self) -> ModelResult:
        return self.shown.model

    @property
    def units(self) -> list[UnitStats]:
        return self.shown.model.units

    @property
    def speedup(self) -> Speedup:
        return self.shown.speedup

    @property
    def replay(self) -> Replay | None:
        return self.shown.replay

    @property
    def findings(self) -> list[Finding]:
        return self.shown.findings

    @property
    def headline(self) -> str:
        from gputrace.report.terminal import headline

        return headline(self.shown)

    def show(self) -> None:
        """Print what `gputrace analyze` prints for this trace and rank: every section."""
        from gputrace.report.terminal_all import render_all

        if self._inputs:
            from gputrace.analysis.extras import beside

            render_all(self.analysis, beside(self.analysis, self.rank, self._inputs).doc,
                       self.rank)
        else:
            from gputrace.report.terminal import render

            render(self.analysis, self.rank)

    # -- the JSON document and its tables --------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The `analyze --json` document (a fresh copy)."""
        if not self._doc:
            from gputrace.report.document import document
            from gputrace.report.json import to_dict

            self._doc.update(document(self.analysis, self.rank, self._inputs)
                             if self._inputs else to_dict(self.analysis, self.rank))
        return plain(self._doc)

    def to_json(self, indent: int | None = 1) -> str:
        """The document as `analyze --json` prints it."""
        return dumps(self.to_dict(), indent)

    def table(self, name: str) -> Table:
        """One of TABLES: `breakdown` (the shown rank's terms, mean and std), `iterations`
        (every iteration of every rank), `units` (comm units of every rank), `ranks` (one
        row per rank), `findings`, `speedup` (points of the speedup model), `what_if`
        (replayed scenarios), `throughput` (samples and tokens per second per rank, and the
        job's over its data-parallel replicas: rank None), `memory` (per rank its peaks over the
        run, phase None, and in each phase, with the phase each peak happened in), `layers`
        (each counted layer's FLOPs, times and achieved FLOP/s), `flops` (per rank: FLOPs per
        iteration, FLOP/s, MFU and HFU), `withheld` (each figure withheld because one of the
        analysis's invariants did not hold, with the invariant and why), `recompute` (per rank
        the forward recomputed in the backward under activation checkpointing, a part of
        t_b: the whole, layer None, and each layer's), `goodput` (the whole run, per rank and
        for the job, rank None: the training steps' and each badput category's seconds and
        share of the wall time); the parallelisms': `tp_layers` (every rank's tensor-parallel
        collectives per layer and phase), `tp_what_if` (the TP-degree what-if),
        `pipeline_stages`, `pipeline_what_if`, `expert_parallel` (per rank, with its bytes
        to each peer): with their columns and no rows for a run without them."""
        from gputrace.report import tables, tables_parallel

        if name not in TABLES:
            raise KeyError(f"no table {name!r}; the tables are {', '.join(TABLES)}")
        if name == "iterations":
            return tables.iterations(self.analysis)
        if name in tables_parallel.TABLES:
            return getattr(tables_parallel, name)(self.to_dict())
        return getattr(tables, name)(self.to_dict())

    def to_pandas(self, name: str = "breakdown") -> Any:
        """A table as a pandas DataFrame (the `notebook` extra)."""
        return self.table(name).to_pandas()

    def to_polars(self, name: str = "breakdown") -> Any:
        """A table as a polars DataFrame (polars installed)."""
        return self.table(name).to_polars()

    # -- charts and the report ---------------------------------------------------------------

    @property
    def chart_ids(self) -> list[str]:
        """The report's charts this analysis has data for, in the page's order."""
        return [c.id for c in self._charts()]

    def _charts(self) -> list[Any]:
        from gputrace.report.charts import charts
        from gputrace.report.document import page_parts

        more = page_parts(self.analysis, self.rank, self._inputs)[0] if self._inputs else ()
        return [*charts(self.analysis, self.shown), *more]

    def chart(self, chart_id: str = "breakdown") -> ChartView:
        """One of the report's charts (its Vega-Lite spec), drawn inline in Jupyter."""
        made = {c.id: c for c in self._charts()}
        if chart_id not in made:
            raise KeyError(f"no chart {chart_id!r} for this trace; it has "
                           f"{', '.join(made) or 'none'}")
        return ChartView(made[chart_id])

    def report(self, height: int = 900) -> ReportView:
        """The whole HTML report (as `gputrace report`), inline in Jupyter; `.save(path)`."""
        from gputrace.report.document import page_parts
        from gputrace.report.html import render, vega_script

        more, found = page_parts(self.analysis, self.rank, self._inputs) if self._inputs \
            else ((), [])
        return ReportView(render(self.analysis, self.rank, vega_script(), self.source, more,
                                 found), height)

    def _repr_html_(self) -> str:
        import html

        items = "".join(f"<li><b>{html.escape(f.severity)}</b> {html.escape(f.message)}</li>"
                        for f in self.findings)
        return (f"<div class=\"gputrace-result\"><p><b>{html.escape(self.headline)}</b></p>"
                f"<p>rank {self.rank} of {self.world_size}; {html.escape(self.source)}</p>"
                f"{self.table('breakdown')._repr_html_()}<ul>{items}</ul></div>")

    def __repr__(self) -> str:
        return f"<gputrace analysis of {self.source or 'a trace'}: rank {self.rank} of " \
               f"{self.world_size}. {self.headline}>"


@dataclass(frozen=True)
class ChartView:
    """A report chart: `spec` is its Vega-Lite specification; in Jupyter it draws itself
    with the Vega bundle the report embeds (no network)."""

    chart: Any      # report.charts.Chart

    @property
    def id(self) -> str:
        return str(self.chart.id)

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.chart.spec)

    def to_html(self) -> str:
        from gputrace.report.html import fragment, vega_script

        return fragment(self.chart, vega_script(), f"gputrace-{self.id}-{secrets.token_hex(4)}")

    def _repr_html_(self) -> str:
        return self.to_html()

    def __repr__(self) -> str:
        return f"<gputrace chart {self.id}: {self.chart.title}>"


@dataclass(frozen=True)
class ReportView:
    """The report page; shown in Jupyter in a frame of its own."""

    html: str
    height: int = 900

    def save(self, path: str | os.PathLike[str]) -> int:
        data = self.html.encode("utf-8")
        with open(path, "wb") as f:
            f.write(data)
        return len(data)

    def _repr_html_(self) -> str:
        from gputrace.report.html import framed

        return framed(self.html, self.height)

    def __repr__(self) -> str:
        return f"<gputrace report page, {len(self.html) / 1e6:.2f} MB>"
