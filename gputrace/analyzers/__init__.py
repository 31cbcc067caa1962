"""Analyzers: pure functions from a loaded trace to frozen results. No I/O, no printing.

Rooms by concern: `core` (a rank's iterations, phases, overlap, comm units, collectives, the
paper's model and the result types), `run` (one analysis of a run: its ranks, in parallel
where worth it), `parallel` (each parallelism a room: `ddp`, `sharded` for FSDP and ZeRO,
`pp`, `ep`, `tp`, behind one registry), `extras` (FLOPs, memory, throughput, goodput, the
window and the whole run, hangs), `findings` (advice and the consistency checks), `compare`
(diffs of two runs or two sets of runs). This module only hands the entry points on."""

from gputrace.analyzers.core.results import Analysis, NothingToAnalyze, RankAnalysis
from gputrace.analyzers.run.analysis import analyze
from gputrace.analyzers.run.reading import parallel_worth_it

__all__ = ["Analysis", "NothingToAnalyze", "RankAnalysis", "analyze", "parallel_worth_it"]
