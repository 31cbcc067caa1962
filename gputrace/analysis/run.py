"""One analysis of a run: its options checked, its inputs loaded, the engine chosen, its
ranks analyzed. `analyze`, `report`, `record --report`, `diff` and the Python API all come
here with an AnalysisOptions."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gputrace.analysis.inputs import AnalysisError, load_inputs
from gputrace.fmt import parse_bytes

if TYPE_CHECKING:
    from gputrace.analyzers import Analysis
    from gputrace.analyzers.parallel.ddp.replay import Scenario

__all__ = ["AnalysisError", "AnalysisOptions", "parse_bandwidth", "parse_bytes",
           "parse_what_if", "run_analysis", "run_diff", "Compared"]


@dataclass(frozen=True)
class AnalysisOptions:
    """What one analysis is asked, checked (AnalysisOptions.of reads them from text).

    `inputs`: what `analyze` takes, read together as one run. `rank`: the rank shown
    (default: the slowest). `skip`: warm-up iterations left out (default: the analyzers').
    `gpus`: GPU counts of the speedup model. `link_bytes_per_s`: eq. 12's link bandwidth.
    `what_if`: replay scenarios. `jobs`: worker processes for the ranks; `dask`, `ray`: a
    cluster's address to analyze them on instead. `batch_size`, `tokens_per_sample`: the
    throughput's batch where the trace does not tell. `calibrate`: another run of the same
    pipeline job at another microbatch count. `align`: put each host on one clock."""

    inputs: tuple[str, ...] = ()
    rank: int | None = None
    skip: int | None = None
    gpus: tuple[int, ...] = (2, 4, 8, 16)
    link_bytes_per_s: float | None = None
    what_if: tuple[Scenario, ...] = ()
    shared_io: bool = False
    jobs: int | None = None
    dask: str | None = None
    ray: str | None = None
    batch_size: int | None = None
    tokens_per_sample: int | None = None
    calibrate: str | None = None
    align: bool = True

    def __post_init__(self) -> None:
        if not self.gpus or min(self.gpus) < 1:
            raise AnalysisError("--gpus takes positive integers like 2,4,8, not "
                                f"{','.join(map(str, self.gpus))!r}")
        if self.skip is not None and self.skip < 0:
            raise AnalysisError("--skip takes a number of iterations, 0 or more, not "
                                f"{self.skip}")
        if self.link_bytes_per_s is not None and not 0 < self.link_bytes_per_s < math.inf:
            raise AnalysisError("--link-bandwidth must be positive and finite, not "
                                f"{self.link_bytes_per_s!r}")
        if self.jobs is not None and self.jobs < 1:
            raise AnalysisError(f"--jobs takes a number of processes, 1 or more, not "
                                f"{self.jobs}")
        if self.dask is not None and self.ray is not None:
            raise AnalysisError("--dask and --ray: choose one engine")
        for opt, v in (("--batch-size", self.batch_size),
                       ("--tokens-per-sample", self.tokens_per_sample)):
            if v is not None and v < 1:
                raise AnalysisError(f"{opt} takes a positive number, not {v}")

    @classmethod
    def of(cls, *, gpus: Sequence[int] | str = (2, 4, 8, 16),
           link_bandwidth: float | str | None = None,
           what_if: Sequence[str | Scenario] | str = (), **given: Any) -> AnalysisOptions:
        """The options from the command line's text or the API's values: `gpus` "2,4,8" or
        numbers, `link_bandwidth` "7GB/s" or bytes/s, `what_if` "gpus=16,bandwidth=2x" or
        Scenarios; the other fields as they are."""
        if not isinstance(gpus, str):
            gpus = ",".join(str(int(g)) for g in gpus)
        try:
            counts = tuple(int(x) for x in gpus.split(",") if x.strip())
            if not counts or min(counts) < 1:
                raise ValueError
        except ValueError:
            raise AnalysisError(f"--gpus takes positive integers like 2,4,8, not {gpus!r}") \
                from None
        if link_bandwidth is not None and not isinstance(link_bandwidth, str):
            link_bandwidth = f"{float(link_bandwidth):.17g}".replace("e+", "e")
        if isinstance(what_if, str):
            what_if = [what_if]
        skip = given.get("skip")
        if skip is not None and skip < 0:   # said before the other options' faults, as ever
            raise AnalysisError(f"--skip takes a number of iterations, 0 or more, not {skip}")
        link = parse_bandwidth(link_bandwidth) if link_bandwidth else None
        scenarios = tuple(parse_what_if(w) if isinstance(w, str) else w for w in what_if)
        if "inputs" in given:
            given["inputs"] = tuple(given["inputs"])
        return cls(gpus=counts, link_bytes_per_s=link, what_if=scenarios, **given)

    def on(self, *inputs: str) -> AnalysisOptions:
        """The same options on other inputs."""
        return replace(self, inputs=tuple(inputs))


def run_analysis(opts: AnalysisOptions, detail: bool = False,
                 use: Executor | None = None, with_beside: bool = True) -> Analysis:
    """The Analysis of `opts.inputs` under `opts`, every user error an AnalysisError;
    `detail` keeps what the HTML report draws (the memory samples among them); `use`: an
    executor to analyze the ranks in (as `dask` or `ray` give one); `with_beside`: make
    what lies beside the ranks' analysis (window, memory, FLOPs, hangs) for the rank shown,
    into `Analysis.beside`, once for every reader of this analysis, from what the ranks'
    parts kept of the rows as they were read (`Analysis.held`: analysis.extras)."""
    from pyarrow import ArrowInvalid

    from gputrace.analysis.parallel import EngineError, cores, executor
    from gputrace.analyzers import NothingToAnalyze, analyze, parallel_worth_it
    from gputrace.trace.ranked import RankedTrace, RankUnreadable

    names = list(opts.inputs)
    if not names:
        raise AnalysisError("no trace given")
    files = all(p.endswith(".arrow") and os.path.isfile(p) for p in names)
    engine = use is not None or opts.dask is not None or opts.ray is not None
    cal = _calibration(opts) if opts.calibrate else None
    kw = dict(skip=opts.skip, gpus=list(opts.gpus), link_bytes_per_s=opts.link_bytes_per_s,
              shared_io=opts.shared_io, what_if=list(opts.what_if), consume=True,
              detail=detail, align=opts.align, calibration=cal,
              batch=(opts.batch_size, opts.tokens_per_sample))
    try:
        with contextlib.ExitStack() as stack:
            # an engine is reached first: an address that does not answer fails before any
            # work is done
            ex = use if use is not None else \
                stack.enter_context(executor(1, opts.dask, opts.ray)) if engine else None
            trace = load_inputs(names, by_rank=True)
            if engine and not isinstance(trace, RankedTrace):
                print(f"gputrace: note: {' '.join(names)} is not written one rank per "
                      "record batch (an import, or a recording not closed): analyzed here, "
                      "not on the cluster", file=sys.stderr)
            if not engine and parallel_worth_it(trace, opts.jobs):
                ex = stack.enter_context(executor(opts.jobs or cores()))
            try:
                a = analyze(trace, executor=ex if isinstance(trace, RankedTrace) else None,
                            **kw)
            except RankUnreadable:   # read it whole instead, recovering every complete batch
                trace = load_inputs(names)
                a = analyze(trace, **kw)
    except EngineError as e:
        raise AnalysisError(str(e)) from None
    except NothingToAnalyze as e:
        raise AnalysisError(f"{' '.join(names)}: {e}") from None
    except (UnicodeDecodeError, ArrowInvalid) as e:
        raise AnalysisError(f"{' '.join(names)}: corrupt trace ({e})") from None
    if opts.rank is not None and opts.rank not in a.ranks:
        raise AnalysisError(f"no rank {opts.rank} in the trace (ranks: "
                            f"{', '.join(map(str, sorted(a.ranks)))})")
    _say_skip_clamped(a, opts.skip, opts.rank)
    if a.held is not None:      # what lies beside it is told apart by the inputs' kind
        a = replace(a, held=replace(a.held, files=files))
    if with_beside:
        from gputrace.analysis.extras import beside

        a = replace(a, beside=beside(a, opts.rank, names, rows=detail))
    return a


DIFF_FORMAT = "gputrace-diff"
DIFF_VERSION = 1


@dataclass(frozen=True)
class Compared:
    """The diff document (`diff --json`) and the two analyses it was made from (for the
    page's timelines); with several runs a side, each side's median run
    (analyzers.compare.diff_runs.median_run of the document's `noise.t_iter_runs`)."""

    doc: dict[str, Any]
    before: Analysis
    after: Analysis


def run_diff(opts: AnalysisOptions, before: str | Sequence[str],
             after: str | Sequence[str]) -> Compared:
    """Two runs, each analyzed as run_analysis does under `opts` (with their detail), and
    their diff: `opts.rank` of both, else each run's slowest rank. A side may be several
    runs of the same job (each input one run, see runs_of): the diff is then of the runs'
    means, its intervals across the runs (analyzers.compare.diff_runs). Every user error an
    AnalysisError."""
    from gputrace.analyzers.compare.diff import compare
    from gputrace.analyzers.compare.diff_runs import Run, compare_runs, median_run

    sides = [runs_of([x] if isinstance(x, str) else list(x)) for x in (before, after)]
    names = [" ".join([x] if isinstance(x, str) else list(x)) for x in (before, after)]
    done = [[_side(opts, path) for path in side] for side in sides]

    def rank(a: Analysis) -> int:
        return opts.rank if opts.rank is not None else a.slowest_rank

    doc: dict[str, Any] = {"format": DIFF_FORMAT, "version": DIFF_VERSION,
                           "before": names[0], "after": names[1]}
    (ab, pb), (aa, pa) = done[0][0], done[1][0]
    if len(sides[0]) == 1 and len(sides[1]) == 1:
        doc.update(compare(ab, aa, rank(ab), rank(aa), pb, pa))
    else:
        doc.update(compare_runs(*([Run(a, rank(a), p) for a, p in side] for side in done)))
        t = doc["noise"]["t_iter_runs"]
        ab, aa = (done[k][median_run(t[s])][0] for k, s in enumerate(("before", "after")))
    doc["runs"] = {"before": sides[0], "after": sides[1]}
    return Compared(doc, ab, aa)


def runs_of(inputs: Sequence[str]) -> list[str]:
    """The runs of one side of a diff: each input one run, except a glob (quoted) whose
    files were recorded at different moments (their metadata's windows apart), which is
    one run per file. Files of one moment (the shards or per-node files of one run) stay
    one run, as a glob is everywhere else."""
    import glob
    import os

    from gputrace.trace.parts import metadata_of, same_moment

    out: list[str] = []
    for p in inputs:
        if os.path.exists(p) or not glob.has_magic(p):
            out.append(p)
            continue
        found = sorted(glob.glob(p))
        mds = [metadata_of(f) for f in found]
        apart = len(found) > 1 and all(
            not same_moment(mds[i], mds[j]) for i in range(len(found))
            for j in range(i + 1, len(found)))
        if apart:
            out.extend(found)
        elif len(found) > 1 and any(not same_moment(mds[0], m) for m in mds[1:]):
            raise AnalysisError(f"{p} matches files of several runs, some of several files "
                                "each: name each run (or its glob) on its own")
        else:
            out.append(p)
    return out


def _side(opts: AnalysisOptions, path: str) -> tuple[Analysis, Any]:
    """One input's analysis (with its detail) and its per-name parts."""
    from gputrace.analyzers.compare.diff_parts import Parts, parts

    a = run_analysis(opts.on(path), detail=True, with_beside=False)
    ra = a.ranks[opts.rank if opts.rank is not None else a.slowest_rank]
    d = ra.detail
    if d is None or ra.iterations - ra.warmup_skipped < 1:
        return a, Parts()
    s = d.series
    table = getattr(load_inputs([path], quiet=True), "table", None)
    if table is None:
        return a, Parts()
    return a, parts(table, ra.rank, s.start_ns[s.warmup:], int(s.end_ns[-1]),
                    None if s.left_out is None else s.left_out - s.warmup,
                    cpus=a.metadata.get("cpus") if isinstance(a.metadata, dict) else None)


def _calibration(opts: AnalysisOptions) -> Any:
    """`calibrate`'s runs (one path, or several joined by commas), each analyzed under the
    same options: their pipelines, what this run's what-ifs fit their compute with (which
    of them fit, and why the others do not, the pipeline section says)."""
    import os

    from gputrace.analyzers.parallel.pp.pp_whatif import calibration_of

    assert opts.calibrate is not None
    paths = [opts.calibrate] if os.path.exists(opts.calibrate) else \
        [p.strip() for p in opts.calibrate.split(",") if p.strip()]
    out = []
    for path in paths:
        a = run_analysis(replace(opts, inputs=(path,), calibrate=None, rank=None, skip=None),
                         with_beside=False)
        pl = next((ra.parallel["pp"] for ra in a.ranks.values() if "pp" in ra.parallel),
                  None)
        if pl is None:
            raise AnalysisError(f"--calibrate {path}: no pipeline in it (it takes a run of "
                                "the same pipeline job at another microbatch count)")
        out.append(calibration_of(pl))
    return out[0] if len(out) == 1 else out


def _say_skip_clamped(a: Analysis, skip: int | None, rank: int | None) -> None:
    """A skip beyond the trace's iterations leaves the last one to analyze: say so."""
    if skip is None:
        return
    ra = a.ranks[rank] if rank is not None else a.main
    if ra.warmup_skipped < skip and not ra.synthetic_iterations:
        print(f"gputrace: note: --skip {skip}: rank {ra.rank} has {ra.iterations} "
              f"iteration{'s' if ra.iterations != 1 else ''}; {ra.warmup_skipped} skipped, "
              f"the last {ra.iterations - ra.warmup_skipped} analyzed", file=sys.stderr)


# -- the options' text ----------------------------------------------------------------------

def parse_bandwidth(text: str) -> float:
    """'7GB/s', '56Gb/s', '12.5e9' -> bytes per second."""
    return parse_bytes(text, "--link-bandwidth", per_second=True)


def parse_what_if(text: str) -> Scenario:
    """'gpus=16,bandwidth=2x,bucket_cap_mb=5' -> a replay Scenario (gpus 0: the run's own)."""
    from gputrace.analyzers.parallel.ddp.replay import MIB, Scenario

    gpus, bw, bucket = 0, 1.0, None
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        try:
            if key == "gpus":
                gpus = int(value)
                ok = gpus >= 1
            elif key == "bandwidth":
                bw = float(value.lower().removesuffix("x"))
                ok = bw > 0
            elif key == "bucket_cap_mb":
                bucket = float(value) * MIB
                ok = bucket > 0
            elif key == "bucket":
                bucket = math.inf if value.lower() in ("one", "all") else \
                    parse_bytes(value, "--what-if bucket")
                ok = True
            else:
                raise AnalysisError(f"--what-if {text!r}: unknown key {key!r} (gpus, "
                                    "bandwidth, bucket_cap_mb, bucket)")
        except AnalysisError:
            raise
        except ValueError:
            ok = False
        if not ok:
            raise AnalysisError(f"--what-if {text!r}: bad value for {key}: {value!r}")
    return Scenario(gpus, bw, bucket)
