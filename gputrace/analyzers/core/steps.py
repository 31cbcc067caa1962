"""Iterations, the per-iteration t_io/t_h2d/t_f/t_b/t_u/t_comm breakdown, hidden vs exposed
comm and I/O, and the comm units (buckets or layers) of each iteration."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.collective_totals import exposed_union
from gputrace.analyzers.core.comm_rows import Rows
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.core.units import LayerEnds, Units, gpu_layer_ends, layer_ends
from gputrace.analyzers.core.units import units as units_of
from gputrace.analyzers.extras import recompute as rc
from gputrace.analyzers.parallel.pp.bubble import passes, with_bubble

TERMS = ("t_iter", "t_io", "t_h2d", "t_f", "t_b", "t_u", "t_comm", "t_other", "t_framework")
# the terms of the parallelisms beyond data parallelism, where a run has them
PARALLEL_TERMS = ("t_tp", "t_pp", "t_ep", "t_cp")


@dataclass(frozen=True)
class Iterations:
    start: np.ndarray
    end: np.ndarray
    step: np.ndarray
    synthetic: bool          # no iteration spans: the whole window is one iteration
    loop: tuple[int, int]    # (pid, tid) of the training loop


@dataclass(frozen=True)
class RankSteps:
    rank: int
    iterations: Iterations
    terms: dict[str, np.ndarray]      # seconds per iteration
    comm: ov.Hidden
    io: ov.Hidden
    units: Units
    layer_backward_s: list[dict[int, float]]   # per iteration: layer -> backward seconds
    layer_ends: LayerEnds
    layer_bytes: dict[int, float]     # layer -> gradient bytes (host backward spans' bytes)
    backward_start: np.ndarray        # ns, per iteration (-1 when none)
    backward_end: np.ndarray          # ns, per iteration (-1 when none)
    fetch_s: np.ndarray               # mean loader fetch per batch, seconds (nan: none)
    loader_workers: int
    update_spans: np.ndarray          # update spans per iteration
    gpu: bool = False                 # phases from GPU records (compute not on the host CPU)
    # the compute the comm is hidden under, as the hidden-vs-exposed comm measures it (the
    # per-kind exposed comm too): a host trace's phases' own work, not their waits; a GPU
    # trace's compute records (`gpu`)
    compute: ov.Union = ov.EMPTY
    # per iteration: the forward recomputed inside the backward (activation checkpointing),
    # a part of t_b, in seconds; and each layer's (analyzers.extras.recompute)
    recompute_s: np.ndarray | None = None
    layer_recompute_s: list[dict[int, float]] = field(default_factory=list)
    # a GPU trace: per iteration, the time its device records (kernels, copies, comm)
    # held a device, each instant once; None for a host trace
    device_busy_s: np.ndarray | None = None


def warmup_skip(n: int, skip: int | None = None) -> int:
    """Iterations to leave out: the first 10% or the first 3, keeping at least half."""
    if skip is not None:
        return max(0, min(skip, n - 1)) if n else 0
    return min(max(math.ceil(0.1 * n), 3), n // 2)


def _profiler_stub(sp: Spans, idx: np.ndarray) -> bool:
    """Whether the last of the iteration spans `idx` (sorted by start) is the stub
    torch.profiler leaves after its last `step()`: a `ProfilerStep#N` open only until the
    profiler stopped, under a tenth of the others' median length with under a tenth of
    their median count of spans begun in it."""
    if idx.size < 2 or not sp.names[int(sp.name[idx[-1]])].startswith("ProfilerStep#"):
        return False
    dur = sp.end[idx] - sp.start[idx]
    if dur[-1] >= 0.1 * float(np.median(dur[:-1])):
        return False
    begun = np.searchsorted(np.sort(sp.start), np.stack([sp.start[idx], sp.end[idx]]))
    count = begun[1] - begun[0]
    return bool(count[-1] < 0.1 * float(np.median(count[:-1])))


def counted_iteration(sp: Spans, its: Iterations, sel: np.ndarray) -> int | None:
    """The analyzed iteration (its index, one of `sel`) whose FLOPs were counted (the `flops`
    span over it, collectors.torch.flops): slowed by the count, it is left out of the
    timing statistics. None where no such iteration is analyzed, or it is the only one."""
    m = np.flatnonzero(sp.of("flops"))
    if not m.size or sel.size < 2 or its.synthetic:
        return None
    at = sp.start[m]
    i = np.searchsorted(its.start, at, side="right") - 1
    ok = (i >= 0) & (at < its.end[np.clip(i, 0, its.end.size - 1)])
    hit = [int(k) for k in i[ok] if int(k) in set(sel.tolist())]
    return hit[0] if hit else None


def find_iterations(sp: Spans) -> Iterations:
    m = sp.of("iteration")
    if "inference" in sp.names:
        # batches that trained nothing (evaluation) are left out when training ones exist
        train = m & (sp.name != sp.names.index("inference"))
        if train.any():
            m = train
    if m.any():
        idx = np.flatnonzero(m)
        idx = idx[np.argsort(sp.start[idx], kind="stable")]
        if _profiler_stub(sp, idx):
            idx = idx[:-1]
        loop = Counter(zip(sp.pid[idx].tolist(), sp.tid[idx].tolist(), strict=True)).most_common(1)[0][0]
        return Iterations(sp.start[idx], sp.end[idx], sp.step[idx], False, loop)
    lo = int(sp.start.min())
    hi = int(max(sp.end.max(), sp.start.max()))
    c = Counter(zip(sp.pid.tolist(), sp.tid.tolist(), strict=True)).most_common(1)[0][0]
    return Iterations(np.array([lo]), np.array([hi]), np.array([0]), True, c)


def _u(sp: Spans, mask: np.ndarray) -> ov.Union:
    m = mask & sp.lasting()   # one copy of the spans that last, worked on in place
    return ov.union(sp.start[m], sp.end[m], own=True)


def analyze_rank(sp: Spans, stood: tuple[np.ndarray, np.ndarray] | None = None,
                 not_units: np.ndarray | None = None,
                 dims: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                 rows: Rows | None = None) -> RankSteps:
    """`stood`: (starts, ends) of the instants the job's thread stood in a collective (a
    synchronous one, an asynchronous one's wait): comm, so not the host phases' compute.
    `rows`: the comm spans' parsed records (collectives.rows), from which a host trace's
    exposed comm is the instants the job stood still for its comm spans
    (collective_totals.exposed_union, the collectives by kind's own); without them, the
    comm spans' time no compute covers.
    `not_units`: per span, comm that is no gradient unit (a collective of a few bytes):
    counted as comm time, left out of the units. `dims`: the instants the thread stood in
    the collectives of tensor, pipeline, expert or context parallelism, each a term of its
    own (`t_tp`, `t_ep`, `t_cp`; `t_pp` also holds the pipeline's bubble: a schedule step's
    time its stage computed nothing), not the phases' compute."""
    its = find_iterations(sp)
    lo, hi = its.start, its.end
    n = lo.size
    pid, tid = its.loop
    on_loop = (sp.pid == pid) & (sp.tid == tid)
    io_m = sp.of("io")
    wait = _u(sp, io_m & on_loop)
    work_m = io_m & ~on_loop
    work = _u(sp, work_m)
    bwd_m = sp.of("backward")
    per_layer = bwd_m & (sp.layer >= 1) & (sp.device < 0)
    rec_m = rc.spans(sp)    # the forward recomputed in the backward: t_b's, not t_f's
    sized = np.flatnonzero(per_layer & ~np.isnan(sp.nbytes))
    ly_sized, first = np.unique(sp.layer[sized], return_index=True)
    layer_bytes = dict(zip(ly_sized.tolist(), sp.nbytes[sized][first].tolist(), strict=True))
    gpu = sp.on_gpu()
    host_comm = sp.of("comm") & (sp.device < 0)
    # the framework's own per-step work outside every phase (Keras's loop, logs, callbacks)
    fw = _u(sp, sp.of("framework") & (sp.device < 0))

    # which iteration each span belongs to: host spans by their start, GPU records by their
    # launch (a kernel runs long after the host launched it, maybe in the next iteration)
    at = sp.start
    launched = gpu & (sp.launch >= 0)
    if launched.any():
        at = np.where(launched, sp.launch, sp.start)
    it_of = np.searchsorted(lo, at, side="right") - 1
    inside = (it_of >= 0) & (at < hi[np.clip(it_of, 0, n - 1)])
    group = np.where(inside, it_of, -1)
    sec = 1e9
    t_iter = (hi - lo) / sec
    layer_end = sp.end
    if gpu.any():
        # GPU trace: each phase's time is the GPU time of the records launched in it, in
        # the iteration of their launch, wherever they ran
        gcomm = gpu & sp.of("comm")
        to_dev = (sp.kind_is("src", "pageable") | sp.kind_is("src", "pinned")) & \
            sp.kind_is("dst", "device")
        h2d_m = gpu & ~gcomm & ((sp.of("memcpy") & to_dev) | sp.in_phase("h2d"))
        comp = gpu & ~gcomm & ~h2d_m
        label = np.full(sp.start.size, 3, dtype=np.int64)      # 3: launched in no phase
        for k, ph in enumerate(("forward", "backward", "update")):
            label[sp.in_phase(ph)] = k
        # launched in a recomputed forward: the backward's work (an older recorder's
        # recompute was a forward span, the innermost phase of its launches)
        label[(label == 0) & rc.launched_in(sp, rec_m)] = 1
        ci = np.flatnonzero(comp)
        dev = sp.device.astype(np.int64)
        rs_, re_, rg, rl, rfirst, rlast = ov.runs(sp.start[ci], sp.end[ci], group[ci],
                                                  dev[ci], label[ci])
        rs_, re_ = _run_bounds(sp, rs_, re_, rl, ci[rfirst], ci[rlast], gpu, dev)
        hi_ = np.flatnonzero(h2d_m)
        # each instant of the device once: forward, backward, update, then copies (a copy
        # beside compute, a phase on another stream at once, counted in the first)
        ph = rl < 3
        excl = ov.grouped_exclusive(
            np.concatenate([rs_[ph], sp.start[hi_]]), np.concatenate([re_[ph], sp.end[hi_]]),
            np.concatenate([rg[ph], group[hi_]]),
            np.concatenate([rl[ph], np.full(hi_.size, 3)]), n, 4) / sec
        ext = np.zeros((n, 4))
        ext[:, :3] = excl[:, :3]
        t_h2d = excl[:, 3]
        comm_m = gcomm if gcomm.any() else host_comm
        compute = _u(sp, gpu & ~gcomm)
        if gcomm.any():
            # the comm a phase run spans while no compute runs is exposed comm, counted as
            # such: not the phase's time too
            bare = ov.subtract(_u(sp, gcomm), compute)
            np.add.at(ext, (rg, rl), -ov.measure(bare, rs_, re_) / sec)
            np.maximum(ext, 0.0, out=ext)
            c = np.flatnonzero(gcomm)
            comm_h = ov.grouped_hidden(sp.start[c], sp.end[c], group[c], n, compute)
        else:
            comm = _u(sp, comm_m)
            comm_h = ov.hidden_under(comm, compute, lo, hi)
        terms = {"t_iter": t_iter, "t_io": ov.measure(wait, lo, hi) / sec, "t_h2d": t_h2d,
                 "t_f": ext[:, 0], "t_b": ext[:, 1], "t_u": ext[:, 2],
                 "t_comm": comm_h.total_s}
        # the device time of the iteration's work in some phase: its phases' runs, copies
        # and comm, each instant once (streams run side by side)
        ph_run = rl < 3
        cm = np.flatnonzero(gcomm)
        busy = ov.grouped_measure(
            np.concatenate([rs_[ph_run], sp.start[hi_], sp.start[cm]]),
            np.concatenate([re_[ph_run], sp.end[hi_], sp.end[cm]]),
            np.concatenate([rg[ph_run], group[hi_], group[cm]]), n) / sec
        # not clipped: a host iteration that ran ahead of the device is shorter than the
        # work launched in it (negative here), the one that waits for it longer; the mean
        # is the time in no phase
        terms["t_other"] = t_iter - terms["t_io"] - busy
        gi = np.flatnonzero(gpu)
        device_busy = ov.grouped_measure(sp.start[gi], sp.end[gi], group[gi], n) / sec
        # of the time in no phase, what the framework's own work holds (the host's time,
        # which may run beside the device's: never more than the time in no phase)
        terms["t_framework"] = np.clip(ov.measure(fw, lo, hi) / sec, 0.0,
                                       np.maximum(terms["t_other"], 0.0))
        terms["t_other"] = terms["t_other"] - terms["t_framework"]
        # a layer's gradient is ready when the GPU has run what was launched for it: the
        # last backward record launched while the host computed that layer's backward
        bwd_gpu = comp & (label == 1)
        rec_s, rec_layers = rc.gpu(sp, rec_m, bwd_gpu, group, n)
        rec_s = np.minimum(rec_s, terms["t_b"])
        layer_end = gpu_layer_ends(sp, per_layer, bwd_gpu)
        back = bwd_gpu
        back_start, back_end = sp.start, sp.end
    else:
        st = st_grad = ov.union(*stood) if stood is not None else ov.EMPTY
        par = {d: ov.union(*v) for d, v in (dims or {}).items()}
        pass_f, pass_b = passes(sp)     # a pipeline's microbatch passes, whole
        par = with_bubble(sp, par, (pass_f, pass_b))
        if par:
            st = ov.merge(st, *par.values())
        h2d = _u(sp, sp.of("h2d"))
        fwd = ov.subtract(_u(sp, (sp.of("forward") & ~rec_m) | pass_f), st)
        phase_b = _u(sp, bwd_m & (sp.device < 0))
        # backward's own work: the per-layer spans where known (the outer autograd call of
        # DDP also waits for its last all-reduce, which no span of the job's thread marks).
        # When the job's thread stood in gradient collectives inside the backward (FSDP's
        # reduce-scatters, a job's own all-reduce), those are its waits: the rest of the
        # phase (layers, the framework's hooks between them) is the backward. Activation
        # all-to-alls in the backward (a MoE layer's, expert parallel) are no such wait:
        # the phase's tail after its layers is still DDP's wait for its last all-reduce
        own_waits = ov.total(ov.intersect(phase_b, ov.merge(st_grad, *(
            u for d, u in par.items() if d != "ep")))) > 0
        # a process with no collective at all has no all-reduce to wait for: its backward
        # is the autograd call, tail included (the gradients' accumulation after the last
        # layer's, the engine's end: 4-5 ms of it beside busy neighbours)
        comm_m = sp.of("comm")
        alone = not comm_m.any()
        bwd = ov.subtract(ov.merge(phase_b if own_waits or alone or not per_layer.any()
                                   else _u(sp, per_layer), _u(sp, pass_b)), st)
        upd = ov.subtract(_u(sp, sp.of("update")), st)
        # two phases at once (TensorFlow runs ops of both on its threads): the time counts
        # once, in the earlier phase; the loop's wait for data, where no compute ran beside
        bwd = ov.subtract(bwd, fwd)
        upd = ov.subtract(upd, ov.merge(fwd, bwd))
        compute = ov.merge(h2d, fwd, bwd, upd)
        comm = _u(sp, comm_m)
        # exposed: the instants the job stood still for its comm, each once, as the
        # collectives by kind count them (a wait() to its end, which may come after the
        # collective's); the whole is the comm in flight and those instants
        exposed = ov.subtract(comm, compute) if rows is None else \
            exposed_union(sp, rows, compute, comm_m[rows.idx])
        comm = ov.merge(comm, exposed)
        terms = {
            "t_iter": t_iter,
            "t_io": ov.measure(ov.subtract(wait, compute), lo, hi) / sec,
            "t_h2d": ov.measure(h2d, lo, hi) / sec,
            "t_f": ov.measure(fwd, lo, hi) / sec,
            "t_b": ov.measure(bwd, lo, hi) / sec,
            "t_u": ov.measure(upd, lo, hi) / sec,
            "t_comm": ov.measure(comm, lo, hi) / sec,
        }
        for d, u in par.items():   # each parallelism's exposed comm (and bubble) a term
            terms[f"t_{d}"] = ov.measure(u, lo, hi) / sec
        phased = ov.merge(wait, compute, exposed, *par.values())
        covered = ov.measure(phased, lo, hi) / sec
        with_fw = ov.measure(ov.merge(phased, fw), lo, hi) / sec
        terms["t_framework"] = with_fw - covered     # the framework's work in no phase
        terms["t_other"] = np.maximum(terms["t_iter"] - with_fw, 0.0)
        in_flight, stood_comm = ov.measure(comm, lo, hi), ov.measure(exposed, lo, hi)
        comm_h = ov.Hidden(in_flight / sec, (in_flight - stood_comm) / sec, stood_comm / sec)
        # backward's own work: per-layer spans where known (the outer autograd call also
        # waits for DDP's last all-reduce, so its end is not the end of the gradients)
        back = per_layer if per_layer.any() else bwd_m
        rec_s, rec_layers = rc.host(sp, rec_m, bwd, lo, hi)
        back_start, back_end = sp.start, sp.end
    io_total = ov.measure(ov.merge(wait, work), lo, hi) / sec
    io_exposed = terms["t_io"]
    io_h = ov.Hidden(io_total, np.maximum(io_total - io_exposed, 0.0), io_exposed)

    layer_bs: list[dict[int, float]] = [dict() for _ in range(n)]
    for i in np.flatnonzero(per_layer & inside):
        k, ly = int(it_of[i]), int(sp.layer[i])
        layer_bs[k][ly] = layer_bs[k].get(ly, 0.0) + (sp.end[i] - sp.start[i]) / sec
    bi = np.flatnonzero(back & inside)
    big = np.iinfo(np.int64).max
    bstart = np.full(n, big, dtype=np.int64)
    bend = np.full(n, -1, dtype=np.int64)
    np.minimum.at(bstart, it_of[bi], back_start[bi])
    np.maximum.at(bend, it_of[bi], back_end[bi])
    bstart[bstart == big] = -1

    ends = layer_ends(sp, per_layer & inside, it_of, n, layer_end)
    unit_m = inside if not_units is None else inside & ~not_units
    units = units_of(sp, comm_m & unit_m, host_comm & ~comm_m & unit_m, it_of, n, ends, bend,
                   compute)

    fetch = np.flatnonzero(work_m)
    workers = len(set(sp.pid[fetch].tolist())) if fetch.size else 0
    fetch_s = float(np.mean(sp.end[fetch] - sp.start[fetch]) / sec) if fetch.size else math.nan
    # optimizer steps per iteration: pieces of the update union (nested ranges count once)
    hu = _u(sp, sp.of("update") & (sp.device < 0))
    upd_n = np.searchsorted(hu[0], hi, "left") - np.searchsorted(hu[1], lo, "right")
    return RankSteps(sp.rank, its, terms, comm_h, io_h, units, layer_bs, ends, layer_bytes,
                     bstart, bend, np.array([fetch_s]), workers, upd_n, bool(gpu.any()),
                     compute, rec_s, rec_layers, device_busy if gpu.any() else None)


def _run_bounds(sp: Spans, start: np.ndarray, end: np.ndarray, label: np.ndarray,
                first: np.ndarray, last: np.ndarray, device_work: np.ndarray,
                dev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each phase run begins and ends on the device, as CUDA events recorded when
    the host entered and left the phase would mark them: it begins when the host entered
    the phase's range (its host spans, merged) or, if the device was still busy then, when
    it became free, never after its first record; it ends when the later of its last record
    and the host's leaving the range. A loop the host holds back (launch-bound) then counts
    the device's waits for the host inside the phase, as the events do, not as time in no
    phase; a loop that runs ahead of the device gets its device time."""
    s_out, e_out = start.copy(), end.copy()
    known = (label < 3) & (sp.launch[first] >= 0)
    if not known.any():
        return s_out, e_out
    w = np.flatnonzero(device_work)
    free = np.full(start.size, -1, dtype=np.int64)
    free[known] = ov.busy_before(sp.start[w], sp.end[w], dev[w], start[known],
                                 dev[first[known]])
    for lb, cat in enumerate(("forward", "backward", "update")):
        u = _u(sp, sp.of(cat) & (sp.device < 0))
        if not u[0].size:
            continue
        for idx, is_start in ((first, True), (last, False)):
            m = (label == lb) & (sp.launch[idx] >= 0)
            if not m.any():
                continue
            t = sp.launch[idx[m]]
            j = np.maximum(np.searchsorted(u[0], t, side="right") - 1, 0)
            inside = (t >= u[0][j]) & (t <= u[1][j])
            if is_start:
                entered = np.where(inside, u[0][j], start[m])
                s_out[m] = np.minimum(start[m], np.maximum(entered, free[m]))
            else:
                e_out[m] = np.maximum(end[m], np.where(inside, u[1][j], end[m]))
    return s_out, e_out
