"""How fast the job is in the units its users count: samples (and tokens) per second, per
rank and for the job.

A rank's samples per iteration: the batch its model takes per forward (the first outermost
forward's input, `args.batch` of that `forward` span: collectors.torch.batch; or
`--batch-size`) times the model's outermost forwards per analyzed iteration (gradient
accumulation's micro-batches, a pipeline stage's microbatches). Tokens: samples x tokens per
sample, where the input is a 2-D integer tensor (token ids), or `--tokens-per-sample`.
Per second: over the rank's mean t_iter.

The job's: the ranks' samples per second summed over the data-parallel replicas only: ranks
of one tensor-, pipeline- or context-parallel group share their samples, so the sum over
the ranks is divided by the product of those degrees."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.analyzers.core.frame import Spans

SHARED_DIMS = ("tp", "pp", "cp")   # ranks of one group of these take the same samples


@dataclass(frozen=True)
class Throughput:
    """One rank's, over its analyzed iterations."""

    samples: float                 # per iteration
    samples_per_s: float
    forwards: float                # the model's outermost forwards per iteration
    tokens_per_sample: int | None
    batch: dict[str, Any]          # the input's description, or the override's
    source: str                    # where the batch came from, in words

    @property
    def tokens_per_s(self) -> float | None:
        return self.samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None

    def as_dict(self) -> dict[str, Any]:
        return {"samples_per_iteration": self.samples, "samples_per_s": self.samples_per_s,
                "tokens_per_sample": self.tokens_per_sample, "tokens_per_s": self.tokens_per_s,
                "forwards_per_iteration": self.forwards, "batch": self.batch,
                "source": self.source}


@dataclass(frozen=True)
class JobThroughput:
    samples_per_s: float
    tokens_per_s: float | None
    replicas: int                  # data-parallel replicas: world / (TP x PP x CP)
    ranks: int                     # ranks whose throughput is known

    def as_dict(self) -> dict[str, Any]:
        return {"samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
                "replicas": self.replicas, "ranks": self.ranks}


def _batch(sp: Spans, fwd: np.ndarray) -> tuple[int, dict[str, Any]] | None:
    """The first outermost forward that carries the input's description: (its name code,
    the description)."""
    args = sp.args.take(pa.array(fwd)).to_pylist() if fwd.size else []
    for i, a in zip(fwd.tolist(), args, strict=True):
        if a and '"batch"' in a:
            try:
                b = json.loads(a).get("batch")
            except (ValueError, AttributeError):
                continue
            if isinstance(b, dict) and isinstance(b.get("samples"), int) and b["samples"] > 0:
                return int(sp.name[i]), b
    return None


def rank(sp: Spans, it_start: np.ndarray, it_end: np.ndarray, sel: np.ndarray,
         t_iter: float, batch_size: int | None = None,
         tokens_per_sample: int | None = None) -> Throughput | None:
    """The rank's throughput, None when neither the trace nor the options tell its batch."""
    if not sel.size or t_iter <= 0:
        return None
    fwd = np.flatnonzero(sp.of("forward") & (sp.layer < 0) & (sp.device < 0))
    found = _batch(sp, fwd)
    if found is None and batch_size is None:
        return None
    forwards = 1.0
    batch: dict[str, Any] = {}
    if found is not None:
        code, batch = found
        mine = fwd[sp.name[fwd] == code]
        it = np.searchsorted(it_start, sp.start[mine], side="right") - 1
        ok = (it >= 0) & (sp.start[mine] < it_end[np.maximum(it, 0)])
        n = np.bincount(it[ok], minlength=it_start.size)[sel]
        forwards = float(n.mean()) if n.size and n.mean() > 0 else 1.0
        first = _first_stage_forwards(sp, it_start, it_end, sel)
        if first is not None:
            forwards = first
    if batch_size is not None:
        samples, source = batch_size, "--batch-size"
    else:
        samples, source = int(batch["samples"]), (
            f"{_input(batch)} ({batch.get('dtype', '?')} {batch.get('shape')})")
    tokens = tokens_per_sample or batch.get("tokens_per_sample") or None
    per_it = samples * forwards
    return Throughput(per_it, per_it / t_iter, forwards, int(tokens) if tokens else None,
                      batch, source)


def _input(batch: dict[str, Any]) -> str:
    """Where the batch was read, in words: 'the input of Net.forward' (its first positional
    argument), 'input_ids, the input of Net.forward' (a keyword argument)."""
    mod, _, arg = str(batch.get("input") or "the model").partition(".forward ")
    if not arg:
        return f"the input of {mod}"
    return f"the input of {mod}.forward" if arg == "input" else \
        f"{arg}, the input of {mod}.forward"


def _first_stage_forwards(sp: Spans, it_start: np.ndarray, it_end: np.ndarray,
                          sel: np.ndarray) -> float | None:
    """A pipeline rank's microbatches per iteration: the forwards of its first stage (its
    `pipeline` forward spans of the lowest stage it holds), each sample counted once where
    the rank holds several stages (interleaved, V schedules); None without them."""
    if "forward" not in sp.names:
        return None
    pipe = np.flatnonzero(sp.of("pipeline") & (sp.name == sp.names.index("forward"))
                          & (sp.device < 0))
    if not pipe.size:
        return None
    stage = []
    for a in sp.args.take(pa.array(pipe)).to_pylist():
        try:
            k = json.loads(a).get("stage") if a else None
        except (ValueError, AttributeError):
            k = None
        stage.append(k if isinstance(k, int) else -1)
    st = np.array(stage)
    if (st < 0).all():
        return None
    mine = pipe[st == st[st >= 0].min()]
    it = np.searchsorted(it_start, sp.start[mine], side="right") - 1
    ok = (it >= 0) & (sp.start[mine] < it_end[np.maximum(it, 0)])
    n = np.bincount(it[ok], minlength=it_start.size)[sel]
    return float(n.mean()) if n.size and n.mean() > 0 else None


def job(per_rank: dict[int, Throughput | None], world: int,
        degrees: dict[str, int]) -> JobThroughput | None:
    """The job's throughput from its ranks' (those known stand for those not)."""
    have = [t for t in per_rank.values() if t is not None]
    if not have:
        return None
    shared = int(np.prod([max(degrees.get(d, 1), 1) for d in SHARED_DIMS]))
    scale = max(world, len(have)) / len(have) / shared
    tok = [t.tokens_per_s for t in have]
    return JobThroughput(sum(t.samples_per_s for t in have) * scale,
                         sum(tok) * scale if all(x is not None for x in tok) else None,
                         max(max(world, len(have)) // shared, 1), len(have))
