"""What an analysis returns: frozen results per rank and for the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gputrace.analyzers.core import collective_totals as ct
from gputrace.analyzers.core.bandwidth import Bandwidth
from gputrace.analyzers.core.clocks import ClockAlignment
from gputrace.analyzers.core.detail import RankDetail
from gputrace.analyzers.core.model import ModelResult, Speedup
from gputrace.analyzers.core.outliers import Outlier
from gputrace.analyzers.findings.rules import Finding
from gputrace.analyzers.parallel.ddp.replay import Replay
from gputrace.analyzers.parallel.sharded import sharded as shd


class NothingToAnalyze(Exception):
    """The trace holds no spans (only samples, or nothing)."""


@dataclass(frozen=True)
class Stat:
    mean: float
    std: float


@dataclass(frozen=True)
class RankAnalysis:
    rank: int
    iterations: int
    warmup_skipped: int
    synthetic_iterations: bool
    breakdown: dict[str, Stat]
    comm: dict[str, float]
    io: dict[str, float]
    model: ModelResult
    speedup: Speedup
    bandwidth: Bandwidth | None
    findings: list[Finding]
    comm_wait_s: float | None = None
    comm_transfer_s: float | None = None
    replay: Replay | None = None
    detail: RankDetail | None = None    # per-iteration figures and a timeline, when asked for
    replay_unavailable: str | None = None   # why there is no what-if replay
    host: str = ""
    collectives: ct.Collectives = field(default_factory=ct.Collectives)
    comm_missing: str | None = None     # several ranks, no collective recorded: why no figure
    sharded: shd.Sharded | None = None  # FSDP: units, exposed per unit, model and what-ifs
    # tensor, pipeline, expert parallelism (analyzers.parallel): this rank's parts, the run's
    # dimensions and their group sizes, and each dimension's view across the ranks
    dims: dict[str, Any] = field(default_factory=dict)
    degrees: dict[str, int] = field(default_factory=dict)
    parallel: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # dimension -> groups
    dimensions: str = ""   # the run's dimensions beyond data parallelism ("FSDP 2 x TP 2, 4 ranks")
    throughput: Any = None   # throughput.Throughput: samples (tokens) per second, this rank's
    # the step of the analyzed iteration whose FLOPs were counted, left out of the timings
    flops_left_out: int | None = None
    # figures withheld because an invariant did not hold (analyzers.findings.invariants): what -> why
    withheld: dict[str, str] = field(default_factory=dict)
    # a GPU trace: per iteration, the device's busy time (its records, each instant once) and
    # the rest of t_iter idle, {"busy_s", "idle_s"}; None for a host trace
    device_busy: dict[str, float] | None = None
    # the forward recomputed in the backward (activation checkpointing), a part of t_b:
    # analyzers.extras.recompute.Recompute
    recompute: Any = None
    # the whole run (analyzers.extras.goodput.Goodput): its training iterations' share of the
    # rank's wall time and the badput by category; None where the trace does not hold it
    goodput: Any = None

    @property
    def analyzed(self) -> int:
        """The iterations the timing statistics hold."""
        return self.iterations - self.warmup_skipped - (self.flops_left_out is not None)

    @property
    def left_out_line(self) -> str | None:
        """The one line that says an analyzed iteration was left out of the timings."""
        if self.flops_left_out is None:
            return None
        return (f"iteration {self.flops_left_out} left out of the timings: its FLOPs were "
                "counted, which slowed it (record --flops off records without the count)")


@dataclass(frozen=True)
class Analysis:
    ranks: dict[int, RankAnalysis]
    slowest_rank: int
    world_size: int
    metadata: dict[str, Any] = field(default_factory=dict)
    clock: ClockAlignment | None = None     # host clock offsets (several hosts)
    outliers: list[Outlier] = field(default_factory=list)
    slowest_why: Outlier | None = None      # the slowest rank, told as an outlier is
    throughput: Any = None   # throughput.JobThroughput: the job's, over its DP replicas
    checks: list[Any] = field(default_factory=list)   # invariants.Check: what did not hold
    # analysis.extras.Beside: what lies beside the ranks' analysis (the window, memory,
    # FLOPs, hangs) for the rank shown, made once by run_analysis from `held`
    beside: Any = None
    # analyzers.extras.held.Held: what the ranks' parts kept of the rows for it
    held: Any = None

    @property
    def main(self) -> RankAnalysis:
        return self.ranks[self.slowest_rank]


def _stat(v: np.ndarray) -> Stat:
    if v.size == 0:
        return Stat(0.0, 0.0)
    return Stat(float(np.mean(v)), float(np.std(v, ddof=1)) if v.size > 1 else 0.0)
