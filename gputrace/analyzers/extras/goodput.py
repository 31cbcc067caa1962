"""The whole run, not only its training iterations: each rank's wall time (its process's
start to the recording's end, the `process` span) split into its training iterations'
time (the goodput) and the badput by category, each instant counted once, in this order:

- evaluation: the evaluation passes and batches (`evaluation` spans);
- checkpointing: the blocking part of saves and loads (`checkpoint` spans; an async save's
  background part runs beside the job and is not counted);
- data_stalls: between the first and the last iteration, the loop's waits for data and its
  loaders' starts and ends (`io` spans on the loop's thread, `loader` spans) outside the
  iterations (whose own wait is their t_io);
- startup: the rest before the first training iteration;
- shutdown: the rest after the last one;
- other: the rest between iterations where a span of the training loop's thread shows it
  at work;
- stalls: the rest between iterations, where nothing recorded explains the time.

An iteration's time after its last recorded phase (analyzers.extras.after_step: the optimizer
step's end to the next batch request, where nothing recorded runs) is no training: it is
between the steps, in `stalls` or `other` as any time there (`after_step_s`).

Training time plus the categories is the wall time (invariants.goodput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.core.steps import Iterations
from gputrace.analyzers.extras import after_step

CATEGORIES = ("startup", "evaluation", "checkpointing", "data_stalls", "stalls", "shutdown",
              "other")
SEC = 1e9
WITHHELD = "the run's goodput and badput"   # the figure invariants.goodput_sum withholds
UNPROFILED = "step (not profiled)"   # a TensorFlow step outside the profiled window (`user`)


@dataclass(frozen=True)
class Goodput:
    """One rank's run (or the job's: ranks' seconds summed), in seconds."""

    wall_s: float
    training_s: float
    badput_s: dict[str, float]          # category -> seconds (CATEGORIES, all present)
    iterations: int
    startup_parts_s: dict[str, float] = field(default_factory=dict)
    evaluation: dict[str, float] = field(default_factory=dict)
    checkpoint: dict[str, float] = field(default_factory=dict)
    ranks: int = 1
    # where each category lies on the run's clock, for the report's chart: (category or
    # "training", start, end) in seconds from the process's start, the MAX_BANDS longest of
    # each category; the seconds of those left out
    bands: tuple[tuple[str, float, float], ...] = ()
    bands_left_out_s: float = 0.0
    keras_saves: bool = False           # the blocking saves are Keras' (no torch advice)
    # a windowed recording: the stalls between steps outside its window, where a data wait
    # or other work of the loop is not recorded, so not told apart from a stall
    stalls_outside_window_s: float = 0.0
    # where the wall time ends: "close" (the recording closed: the `run` span's end), or
    # "last_record" (a run that never closed, killed then recovered: its last record)
    ends_at: str = "close"
    # the training iterations' time after their last recorded phase (analyzers.extras.after_step),
    # taken out of training_s: all of it, and its part in `stalls` (the rest is `other`)
    after_step_s: float = 0.0
    after_step_stalls_s: float = 0.0
    # what shut-down shows of itself where it is told: gputrace's pipeline probe
    # (`record --pp-probe`, after the last iteration) and the rest; {} where nothing is
    shutdown_parts_s: dict[str, float] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.training_s / self.wall_s if self.wall_s > 0 else float("nan")

    def share(self, category: str) -> float:
        return self.badput_s[category] / self.wall_s if self.wall_s > 0 else float("nan")

    def as_dict(self) -> dict[str, object]:
        return {"wall_s": self.wall_s, "training_s": self.training_s,
                "goodput": _n(self.goodput), "badput_s": dict(self.badput_s),
                "badput_share": {k: _n(self.share(k)) for k in CATEGORIES},
                "iterations": self.iterations, "startup_parts_s": dict(self.startup_parts_s),
                "shutdown_parts_s": dict(self.shutdown_parts_s) or None,
                "evaluation": {k: _n(v) for k, v in self.evaluation.items()},
                "checkpoint": {k: _n(v) for k, v in self.checkpoint.items()},
                "ranks": self.ranks,
                "stalls_outside_window_s": self.stalls_outside_window_s,
                "ends_at": self.ends_at, "after_step_s": self.after_step_s,
                "after_step_stalls_s": self.after_step_stalls_s}


def _n(x: float) -> float | None:
    """A figure for JSON: null where it cannot be computed (NaN)."""
    return None if x != x else x


def _u(sp: Spans, m: np.ndarray) -> ov.Union:
    m = m & sp.lasting()
    return ov.union(sp.start[m], sp.end[m])


def _clip(u: ov.Union, lo: int, hi: int) -> ov.Union:
    return ov.intersect(u, (np.array([lo], np.int64), np.array([hi], np.int64)))


def _s(u: ov.Union) -> float:
    return ov.total(u) / SEC


def of_rank(sp: Spans, its: Iterations) -> Goodput | None:
    """The rank's goodput and badput; None without the process's `run` span (a trace
    recorded before it, an import) or without a training iteration. A run that never
    closed (killed: its shards recovered) has no `run` span but its `start`: its wall
    time ends at the last thing its training process recorded."""
    run = np.flatnonzero(sp.of("process") & (sp.name == _code(sp, "run")))
    ends_at = "close"
    if not run.size:
        run = np.flatnonzero(sp.of("process") & (sp.name == _code(sp, "start")))
        ends_at = "last_record"
    # a windowed recording's iterations outside its window (its `run` entries)
    o0, o1, o_after = _outside(sp)
    if its.synthetic and o0.size:
        # a window that holds no training iteration: the steps outside it are the run's
        its = _loop_of_outside(sp, its)
    if not run.size or its.synthetic or not (its.start.size or o0.size):
        return None
    lo, hi = int(sp.start[run].min()), int(sp.end[run].max())
    if ends_at == "last_record":
        # the training process's last record (a loader worker's shard may run on further
        # than the last batch its parent flushed before the kill: training it did not
        # record)
        mine = sp.pid == its.loop[0]
        hi = max(hi, int(sp.end[mine].max()), int(sp.start[mine].max()))
    if hi <= lo:
        return None
    # the training steps: the iterations, and a TensorFlow job's steps outside its profiled
    # window (steps whose boundaries are known, their phases not)
    unprofiled = sp.of("user") & (sp.name == _code(sp, UNPROFILED)) & sp.lasting()
    t0 = np.concatenate([its.start, sp.start[unprofiled], o0])
    t1 = np.concatenate([its.end, sp.end[unprofiled], o1])
    first, last = int(t0.min()), int(t1.max())
    # torch.compile's compilations are start-up's wherever they fall (the first call's lies
    # inside the first training step): out of the training time
    comp = _clip(_u(sp, _compiles(sp)), lo, hi)
    train = ov.subtract(_clip(ov.union(t0, t1), lo, hi), comp)
    # each step's time after its last recorded phase (where known: a step in full detail,
    # or outside the window where the recorder wrote it) is no training
    out_after = ov.union(o1 - o_after, o1)      # their `run` entries' `after_us`
    after = ov.intersect(train, ov.merge(after_step.tails(sp, its.start, its.end, its.loop),
                                         out_after))
    train = ov.subtract(train, after)
    # evaluation batches recorded as iterations (before the first optimizer step, or by an
    # older recorder) are evaluation where training iterations are the run's
    ev_m = sp.of("evaluation") | (sp.of("iteration") & (sp.name == _code(sp, "inference")))
    ck_m = sp.of("checkpoint") & ~_background(sp)
    pid, tid = its.loop
    loop = (sp.pid == pid) & (sp.tid == tid)
    data_m = (sp.of("io") & loop) | sp.of("loader")
    taken = train
    out: dict[str, ov.Union] = {}
    # the loaders' start before the first iteration is start-up's, after the last one
    # shut-down's
    for name, m, a, b in (("evaluation", ev_m, lo, hi), ("checkpointing", ck_m, lo, hi),
                          ("data_stalls", data_m, first, last)):
        out[name] = ov.subtract(_clip(_u(sp, m), a, b), taken)
        taken = ov.merge(taken, out[name])
    rest = ov.subtract((np.array([lo], np.int64), np.array([hi], np.int64)), taken)
    compiling = ov.intersect(rest, comp)
    startup = ov.merge(_clip(rest, lo, first), compiling)
    rest = ov.subtract(rest, compiling)
    shutdown = _clip(rest, last, hi)
    between = _clip(rest, first, last)
    # the training loop's thread at work: its own spans (a phase, the framework's, the
    # user's), not a loader worker's prefetch or a background save beside a stall
    work = _u(sp, loop & (sp.device < 0) & ~sp.of("iteration") & ~sp.of("process")
              & ~sp.of("run"))
    other = ov.intersect(between, work)
    stalls = ov.subtract(between, work)
    unseen = _s(ov.intersect(stalls, ov.merge(_unrecorded(its.start, its.end, o0, o1),
                                               out_after)))
    parts = {"training": train, "startup": startup, **out, "stalls": stalls,
             "shutdown": shutdown, "other": other}
    bands, left = _bands(parts, lo)
    badput = {"startup": _s(startup), "evaluation": _s(out["evaluation"]),
              "checkpointing": _s(out["checkpointing"]), "data_stalls": _s(out["data_stalls"]),
              "stalls": _s(stalls), "shutdown": _s(shutdown),
              "other": _s(other)}
    return Goodput((hi - lo) / SEC, _s(train), badput, int(t0.size),
                   _startup_parts(sp, startup), _evaluation(sp), _checkpoint(sp),
                   bands=bands, bands_left_out_s=left, keras_saves=_keras_saves(sp, ck_m),
                   stalls_outside_window_s=unseen, ends_at=ends_at,
                   after_step_s=_s(after), after_step_stalls_s=_s(ov.intersect(stalls, after)),
                   shutdown_parts_s=_shutdown_parts(sp, shutdown))


def _outside(sp: Spans) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A windowed recording's training iterations outside its window: its `run` entries'
    (gputrace.window.pack), starts, ends and time after the last phase (after_step) in ns;
    an inference batch's are not training."""
    from gputrace.window import unpack

    idx = np.flatnonzero(sp.of("run") & (sp.name != _code(sp, "inference")))
    got = [(s, e, min(max(sums.get("after", 0), 0), e - s)) for i in idx
           for _, s, e, sums in unpack(int(sp.start[i]), int(sp.end[i]), int(sp.step[i]),
                                       sp.args[int(i)].as_py())]
    if not got:
        return (np.zeros(0, np.int64),) * 3
    a = np.array(got, np.int64)
    return a[:, 0], a[:, 1], a[:, 2]


def _loop_of_outside(sp: Spans, its: Iterations) -> Iterations:
    """No iteration in the window (its.synthetic: the whole trace as one): none recorded
    in full, the training loop the thread that wrote the `run` entries."""
    idx = np.flatnonzero(sp.of("run") & (sp.name != _code(sp, "inference")))
    none = np.zeros(0, np.int64)
    return Iterations(none, none, none, False, (int(sp.pid[idx[0]]), int(sp.tid[idx[0]])))


def _unrecorded(i0: np.ndarray, i1: np.ndarray, o0: np.ndarray, o1: np.ndarray
                ) -> ov.Union:
    """Between two training steps of which one lies outside the window: where the loop's
    own spans were folded into its `run` entries (none outside it, none unrecorded)."""
    if not o0.size:
        return ov.EMPTY
    s = np.concatenate([i0, o0])
    e = np.concatenate([i1, o1])
    inside = np.concatenate([np.ones(i0.size, bool), np.zeros(o0.size, bool)])
    order = np.argsort(s, kind="stable")
    s, e, inside = s[order], e[order], inside[order]
    gap = ~(inside[:-1] & inside[1:]) & (s[1:] > e[:-1])
    return ov.union(e[:-1][gap], s[1:][gap])


MAX_BANDS = 500     # a category's intervals the report's chart draws at most


def _bands(parts: dict[str, ov.Union], lo: int
           ) -> tuple[tuple[tuple[str, float, float], ...], float]:
    """Each category's intervals on the run's clock (s from `lo`), its MAX_BANDS longest,
    and the seconds of those left out."""
    out: list[tuple[str, float, float]] = []
    left = 0
    for name, (a, b) in parts.items():
        keep = np.sort(np.argsort(b - a, kind="stable")[::-1][:MAX_BANDS])
        left += int((b - a).sum() - (b[keep] - a[keep]).sum())
        out += [(name, (int(x) - lo) / SEC, (int(y) - lo) / SEC)
                for x, y in zip(a[keep], b[keep], strict=True) if y > x]
    return tuple(sorted(out, key=lambda r: r[1])), left / SEC


def _compiles(sp: Spans) -> np.ndarray:
    """torch.compile's compilations (collectors.torch.startup)."""
    return sp.of("startup") & (sp.name == _code(sp, "compile"))


def _code(sp: Spans, name: str) -> int:
    return sp.names.index(name) if name in sp.names else -2


def _background(sp: Spans) -> np.ndarray:
    return sp.name == _code(sp, "dcp.async_save (background)")


def _startup_parts(sp: Spans, startup: ov.Union) -> dict[str, float]:
    """What start-up shows of itself, each part within it: the process's start to torch's
    import returning (the interpreter, the imports before torch and torch's own; where
    record saw that import end: the `start` span's `until`), the distributed
    initialization, the loaders' start before the first iteration, and the rest
    (`other_s`: the job's other imports and set-up, its model's construction, not told
    apart)."""
    init = ov.intersect(
        _u(sp, sp.of("startup") & (sp.name == _code(sp, "init_process_group"))), startup)
    loader = ov.subtract(ov.intersect(_u(sp, sp.of("loader")), startup), init)
    comp = ov.subtract(ov.intersect(_u(sp, _compiles(sp)), startup), ov.merge(init, loader))
    out = {"init_process_group_s": _s(init), "loader_start_s": _s(loader)}
    if comp[0].size:
        out["compile_s"] = _s(comp)
    seen = ov.merge(ov.merge(init, loader), comp)
    st = np.flatnonzero(sp.of("process") & (sp.name == _code(sp, "start")))
    if st.size and '"until":"torch imported"' in (sp.args[int(st[0])].as_py() or ""):
        imp = ov.subtract(ov.intersect(ov.union(sp.start[st[:1]], sp.end[st[:1]]), startup),
                          seen)
        out = {"torch_import_s": _s(imp), **out}
        seen = ov.merge(seen, imp)
    out["other_s"] = max(0.0, _s(startup) - _s(seen))
    return out


def _shutdown_parts(sp: Spans, shutdown: ov.Union) -> dict[str, float]:
    """What shut-down shows of itself: gputrace's pipeline probe (its `process` span
    `pp_probe`) and the rest; {} without a probe."""
    probe = ov.intersect(_u(sp, sp.of("process") & (sp.name == _code(sp, "pp_probe"))),
                         shutdown)
    if not probe[0].size:
        return {}
    return {"pp_probe_s": _s(probe), "other_s": max(0.0, _s(shutdown) - _s(probe))}


def _evaluation(sp: Spans) -> dict[str, float]:
    passes = sp.of("evaluation") & (sp.name == _code(sp, "pass"))
    batches = sp.of("evaluation") & (sp.name == _code(sp, "batch"))
    n, b = int(passes.sum()), int(batches.sum())
    if not n and not b:
        return {}
    dp = (sp.end[passes] - sp.start[passes]) / SEC
    db = (sp.end[batches] - sp.start[batches]) / SEC
    return {"passes": n, "batches": b,
            "per_pass_s": float(dp.mean()) if n else float("nan"),
            "per_batch_s": float(db.mean()) if b else float("nan")}


def _keras_saves(sp: Spans, m: np.ndarray) -> bool:
    names = {sp.names[c] for c in np.unique(sp.name[m]) if 0 <= c < len(sp.names)}
    return bool(names) and all(n.startswith("keras.") for n in names)


def _checkpoint(sp: Spans) -> dict[str, float]:
    m = sp.of("checkpoint")
    if not m.any():
        return {}
    bg = _background(sp) & m
    fg = m & ~bg
    idx = np.flatnonzero(fg)
    dur = (sp.end[idx] - sp.start[idx]) / SEC
    known = ~np.isnan(sp.nbytes[idx])
    nbytes = float(np.nansum(sp.nbytes[idx]))
    bg_dur = (sp.end[bg] - sp.start[bg]) / SEC
    bg_bytes = float(np.nansum(sp.nbytes[bg])) if bg.any() else 0.0
    # a save's rate: its bytes over its own time (those whose bytes are known)
    timed = float(dur[known].sum())
    return {"count": int(idx.size), "seconds": float(dur.sum()), "bytes": nbytes,
            "per_save_s": float(dur.mean()) if idx.size else float("nan"),
            "bytes_per_s": nbytes / timed if timed > 0 and nbytes > 0 else float("nan"),
            "background_count": int(bg.sum()), "background_s": float(bg_dur.sum()),
            "background_bytes": bg_bytes}


def job(ranks: list[Goodput | None]) -> Goodput | None:
    """The job's: every rank's seconds summed (rank-seconds), so its goodput is the ranks'
    training time over their wall time; None where no rank has one."""
    got = [g for g in ranks if g is not None]
    if not got:
        return None
    if len(got) == 1:
        return got[0]
    return Goodput(sum(g.wall_s for g in got), sum(g.training_s for g in got),
                   {k: sum(g.badput_s[k] for g in got) for k in CATEGORIES},
                   max(g.iterations for g in got), ranks=len(got),
                   stalls_outside_window_s=sum(g.stalls_outside_window_s for g in got),
                   ends_at="close" if all(g.ends_at == "close" for g in got) else "last_record",
                   after_step_s=sum(g.after_step_s for g in got),
                   after_step_stalls_s=sum(g.after_step_stalls_s for g in got),
                   shutdown_parts_s=_summed([g.shutdown_parts_s for g in got]))


def _summed(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the ranks' seconds summed (a rank without the key adds none)."""
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


# the findings of the run's time beyond its iterations (goodput_findings)
FINDINGS = ("evaluation_large", "checkpoint_large", "stalls_large", "startup_large")
