"""Every collective a rank issued, by kind: which comm spans are gradient units of the
data-parallel model (DDP's buckets, NCCL kernels, a job's own gradient all-reduces) and which
are other collectives (a buffer broadcast, a barrier, an MoE all-to-all, FSDP's all-gathers),
per-kind totals per iteration (analyzers.core.collective_totals), and whether a multi-rank trace
recorded any collective at all.

Comm spans follow the record contract: cat `comm`, name = kind, `args` with `kind`,
`bytes_out`, `group`, `async`, `phase`, `wait` [start_ns, end_ns] and, under FSDP, `fsdp`,
`unit`, `role`, `prefetch`. DDP's bucket spans (name `allreduce`, no `kind`) stay gradient
units exactly as before."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import fields, replace
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.analyzers.core.backward_wait import with_backward_waits
from gputrace.analyzers.core.comm_rows import KINDS, Rows, kind_of
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.parallel.classify import group_name, mesh_dim, role
from gputrace.analyzers.parallel.ep.capacity import capacity_rows

PARALLEL = frozenset(("tp", "pp", "ep", "cp"))

# the roles of FSDP's collectives (args.role) and the side of the iteration they belong to
# (`step_gather`: DeepSpeed ZeRO's updated partitions all-gathered in the optimizer's step)
ROLES = ("unshard", "reshard_gather", "reduce_grad", "hsdp_all_reduce", "step_gather")

# A collective of a few values (a gradient norm, an overflow or skip flag, a loss scale, a
# metric) is never a gradient unit nor the base of a cost fit: one that moves under
# SMALL_BYTES (1 KiB, 256 fp32 values: less than any layer worth a bucket of its own) and
# under SMALL_SHARE of the run's gradient bytes per iteration (the model's gradient, from
# the backward spans' bytes, or at least the largest collective's). Both must
# hold, so a toy model whose whole gradient is a few hundred bytes keeps its units. Its
# time stays comm time (t_comm, hidden vs exposed); it is listed by kind as not gradient.
SMALL_BYTES = 1024
SMALL_SHARE = 0.01


def _parse(a: str | None) -> dict[str, Any]:
    if not a:
        return {}
    try:
        v = json.loads(a)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def _int(v: Any, default: int = -1) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def rows(sp: Spans) -> Rows:
    """Parse every comm span's args (each distinct args string once)."""
    idx = np.flatnonzero(sp.of("comm"))
    if idx.size:
        taken = sp.args.take(pa.array(idx))
        if isinstance(taken, pa.ChunkedArray):
            taken = taken.combine_chunks()
        enc = taken.dictionary_encode()
        parsed = [_parse(a) for a in enc.dictionary.to_pylist()] + [{}]
        codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        parsed, codes = [{}], np.zeros(0, np.int64)
    # a row's fields come from its args, name and (role) bytes: each combination read once
    nbytes_all = sp.nbytes[idx]
    key = np.stack([codes, sp.name[idx].astype(np.int64), nbytes_all.view(np.int64)], axis=1)
    firsts, inv = (a.reshape(-1) for a in np.unique(key, axis=0, return_index=True,
                                                   return_inverse=True)[1:])
    args = [parsed[c] for c in codes[firsts].tolist()]
    kinds, phase, fsdp, unit, roles, mdims, granks = [], [], [], [], [], [], []
    n = firsts.size
    contract = np.zeros(n, bool)
    bout = np.full(n, np.nan)
    asy = np.zeros(n, bool)
    ws = np.full(n, -1, np.int64)
    we = np.full(n, -1, np.int64)
    pre = np.zeros(n, bool)
    gsize = np.full(n, -1, np.int64)
    cs = np.full(n, -1, np.int64)
    ce = np.full(n, -1, np.int64)
    for j, (i, a) in enumerate(zip(idx[firsts].tolist(), args, strict=True)):
        k = a.get("kind")
        contract[j] = isinstance(k, str) and k in KINDS
        if not contract[j]:
            k = kind_of(sp.names[sp.name[i]]) or "all_reduce"
        kinds.append(k)
        phase.append(str(a.get("phase") or ""))
        fsdp.append(str(a.get("fsdp") or ""))
        u = a.get("unit")
        unit.append(u if isinstance(u, str) else None)
        roles.append(str(a.get("role") or ""))
        bo = a.get("bytes_out")
        if isinstance(bo, (int, float)):
            bout[j] = float(bo)
        asy[j] = bool(a.get("async"))
        w = a.get("wait")
        if isinstance(w, list) and len(w) == 2 and all(isinstance(x, int) for x in w) and \
                w[1] >= w[0]:
            ws[j], we[j] = w
        pre[j] = bool(a.get("prefetch"))
        c = a.get("call")
        if isinstance(c, list) and len(c) == 2 and all(isinstance(x, int) for x in c):
            cs[j], ce[j] = c
        g = a.get("group")
        gr = None
        if isinstance(g, dict):
            gsize[j] = _int(g.get("size"))
            ranks = g.get("ranks")
            if isinstance(ranks, list) and all(isinstance(x, int) for x in ranks):
                gr = tuple(ranks)
        granks.append(gr)
        mdims.append(mesh_dim(a))
    # FSDP's own mesh dimensions: the groups its units ran their collectives on
    own = frozenset(group_name(a) for a, f in zip(args, fsdp, strict=True) if f) - {""}
    told = [role(k, bool(c), a, float(nb), own) for k, c, a, nb
            in zip(kinds, contract.tolist(), args, nbytes_all[firsts].tolist(), strict=True)]
    kinds, phase, fsdp, unit, roles, mdims, granks, told = (   # each row as its combination's
        _per_row(v, inv) for v in (kinds, phase, fsdp, unit, roles, mdims, granks, told))
    contract, bout, asy, ws, we, pre, gsize, cs, ce = (
        v[inv] for v in (contract, bout, asy, ws, we, pre, gsize, cs, ce))
    nbytes = nbytes_all
    # a MoE layer's capacity agreed before its dispatch: expert parallel, from its context
    cap = capacity_rows(sp.start[idx], kinds, contract, phase, granks, nbytes, told)
    told = [("ep", "") if c else t for c, t in zip(cap.tolist(), told, strict=True)]
    dims = [d for d, _ in told]
    r = Rows(idx, kinds, contract, nbytes, bout, asy, phase, ws, we, fsdp, unit,
             roles, pre, gsize, call_s=cs, call_e=ce, dim=dims, mesh_dim=mdims,
             group_ranks=granks)
    grad = _gradient(sp, r)
    below = min(SMALL_BYTES, SMALL_SHARE * gradient_bytes(sp, r))
    # FSDP's own collectives are its units' (parameters and gradients), whatever their size
    small = grad & ~np.array([bool(f) for f in fsdp], bool) & (r.nbytes < below)
    # under FSDP every collective is the sharded model's comm, but only FSDP's own are its
    # dimension: a barrier or a broadcast beside them is no data-parallel dimension (a
    # gradient collective of a few bytes stays `dp`, but gives no degree: registry.degrees)
    dp = not is_sharded(r)
    owner = "FSDP's" if any(f.startswith("fsdp") for f in fsdp) else "the sharded model's"
    final, why = [], []
    for (d, w), k, ph, g_ in zip(told, kinds, phase, grad.tolist(), strict=True):
        if d == "" and g_ and dp:
            d = "dp"
        elif d == "":
            what = f"the job's own {k.replace('_', '-')}"
            where = f"in the {ph}" if ph in ("forward", "backward") else "outside the backward"
            d, w = "other", (f"{what} beside {owner} units (a count, a metric, a flag): not "
                             "the sharded model's" if not dp else
                             f"not gradient: {what} {where}, on a group named for no "
                             "parallelism")
        final.append(d)
        why.append(w)
    return with_backward_waits(sp, replace(r, gradient=grad, dim=final, why=why, small=small,
                                           small_below=below))


def gradient_bytes(sp: Spans, r: Rows) -> float:
    """The run's gradient bytes per iteration, as far as the trace tells: the model's (each
    layer's backward span carries its gradient's bytes), and at least the largest
    collective's (a gradient bucket, or a reduce-scatter or broadcast of the model's
    tensors)."""
    m = np.flatnonzero(sp.of("backward") & (sp.layer >= 1) & (sp.device < 0)
                       & ~np.isnan(sp.nbytes))
    _, first = np.unique(sp.layer[m], return_index=True)
    model = float(sp.nbytes[m][first].sum()) if m.size else 0.0
    nb = r.nbytes[~np.isnan(r.nbytes)]
    return max(model, float(nb.max()) if nb.size else 0.0)


def small_mask(r: Rows) -> np.ndarray:
    """Which comm rows are gradient collectives of a few bytes (never gradient units)."""
    return r.small if r.small.size == r.n else np.zeros(r.n, bool)


def _per_row(values: list[Any], inv: np.ndarray) -> list[Any]:
    """`values[j]` for each j of `inv`, the same objects (one C loop, not a Python one)."""
    held = np.empty(len(values), object)
    for i, v in enumerate(values):    # (a tuple put in whole, not spread over a row)
        held[i] = v
    return held[inv].tolist()


def told_other(r: Rows) -> np.ndarray:
    """Which comm rows classify.role told serve no parallelism, with a reason beyond the
    data-parallel rule's (a gradient norm or a loss outside the forward and backward, a
    scalar, a DTensor redistribution on FSDP's mesh; a barrier is left as it was)."""
    if len(r.why) != r.n:
        return np.zeros(r.n, bool)
    return np.array([d == "other" and bool(w) and k != "barrier"
                     for d, w, k in zip(r.dim, r.why, r.kind, strict=True)], bool)


def never_units(r: Rows) -> np.ndarray:
    """Which comm rows the data-parallel model never takes as units, though their time is
    comm: gradient collectives of a few bytes, and those told to serve no parallelism."""
    grad = r.gradient if r.gradient.size == r.n else np.zeros(r.n, bool)
    return small_mask(r) | (told_other(r) & grad)


def not_units(sp: Spans, r: Rows) -> np.ndarray | None:
    """Per span, the comm rows the data-parallel model must not take as units (None: no
    such row)."""
    sm = never_units(r)
    if not sm.any():
        return None
    out = np.zeros(sp.start.size, bool)
    out[r.idx[sm]] = True
    return out


def subset(r: Rows, keep: np.ndarray) -> Rows:
    """The rows `keep` (a mask over r's rows) as Rows of their own."""
    idx = np.flatnonzero(keep)
    out = {}
    for f in fields(r):
        v = getattr(r, f.name)
        if isinstance(v, np.ndarray) and v.shape[:1] == (r.n,):
            out[f.name] = v[idx]
        elif isinstance(v, list) and len(v) == r.n:
            out[f.name] = [v[i] for i in idx.tolist()]
        else:
            out[f.name] = v
    return Rows(**out)


def is_sharded(r: Rows) -> bool:
    """The rank ran FSDP (or another sharded strategy the collector names)."""
    return any(r.fsdp)


def gradient_mask(sp: Spans, r: Rows) -> np.ndarray:
    """Which of the comm rows are gradient units for the data-parallel (DDP) model (found
    once, when the rows are parsed)."""
    return r.gradient if r.gradient.size == r.n else _gradient(sp, r)


def _gradient(sp: Spans, r: Rows) -> np.ndarray:
    """Which of the comm rows are gradient units for the data-parallel (DDP) model.

    - spans without args.kind (DDP's buckets, imported NCCL kernels, gloo ranges): as before;
    - under FSDP its own collectives are (the sharded model reads them: its units), under
      DeepSpeed's ZeRO every collective is;
    - else, when the rank shows DDP buckets, no recorded collective is (the buckets' own
      collectives are not recorded twice; a buffer broadcast or a barrier is not gradient),
      but the experts' gradients all-reduced over their expert-data-parallel group
      (_expert_dp);
    - else a job's own all-reduces issued in backward, update or outside any phase (manual
      gradient averaging) are, other collectives are not;
    - never a collective of tensor, pipeline, expert or context parallelism (one that
      classify.role tells is `other` with its reason, a gradient norm outside the forward
      and backward, may be gradient comm here, but never a unit: never_units)."""
    # tensor, pipeline, expert and context parallelism's collectives never are
    par = np.array([d in PARALLEL for d in r.dim], bool) if len(r.dim) == r.n \
        else np.zeros(r.n, bool)
    if is_sharded(r):
        if any(f.startswith("fsdp") for f in r.fsdp):
            # torch's FSDP: its model is its units; a collective beside them (a gradient
            # norm, a token count gathered, a barrier) is the job's, its time where the job
            # spent it
            return ~par & np.array([bool(f) for f in r.fsdp], bool)
        return ~par
    g = ~r.contract & ~par
    if (~r.contract & (sp.device[r.idx] < 0)).any():
        return g | _expert_dp(r, par)
    own = np.array([c and k == "all_reduce" and ph in ("backward", "update", "none", "")
                    for c, k, ph in zip(r.contract, r.kind, r.phase, strict=True)], bool)
    return (g | own) & ~par


def _expert_dp(r: Rows, par: np.ndarray) -> np.ndarray:
    """Beside DDP's buckets, the job's own all-reduces of the experts' gradients over their
    expert-data-parallel group: after the forward (backward, update, no phase), more than a
    few bytes, on a group that shares no rank but this one with the rank's expert-parallel
    group (the replicas of the same experts on other expert-parallel groups)."""
    ep = [set(g) for g, d in zip(r.group_ranks or [], r.dim, strict=False)
          if d == "ep" and g]
    if not ep or len(r.group_ranks) != r.n:
        return np.zeros(r.n, bool)
    mine = set.union(*ep)
    out = np.zeros(r.n, bool)
    for i, (c, k, ph, g) in enumerate(zip(r.contract, r.kind, r.phase, r.group_ranks,
                                          strict=True)):
        nb = r.nbytes[i]
        out[i] = bool(c and k == "all_reduce" and ph in ("backward", "update", "none", "")
                      and g and len(g) > 1 and len(set(g) & mine) == 1
                      and not par[i] and nb == nb and nb > 64)
    return out


def stood(sp: Spans, r: Rows, dim: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """When the job's thread stood in a collective the model counts as comm: a synchronous
    one's whole span, an asynchronous one's wait. Recorded collectives only (DDP's buckets
    run beside the backward): the phases' compute does not include these instants. `dim`:
    those of one parallelism (tp, pp, ep, cp) instead of the gradient comm."""
    if dim is None:
        g = gradient_mask(sp, r) & r.contract
    else:
        g = np.array([d == dim for d in r.dim], bool) & r.contract
    sync = g & ~r.is_async & (r.wait_s < 0)
    waited = g & (r.wait_s >= 0)
    # an asynchronous one's issuing call too, where recorded (functional collectives)
    called = (g & (r.call_s >= 0)) if r.call_s.size == r.n else np.zeros(r.n, bool)
    return (np.concatenate([sp.start[r.idx[sync]], r.wait_s[waited], r.call_s[called]]),
            np.concatenate([sp.end[r.idx[sync]], r.wait_e[waited], r.call_e[called]]))


def stood_by_dim(sp: Spans, r: Rows) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """stood() of each parallelism beyond data parallelism the rank's collectives serve."""
    return {d: stood(sp, r, d) for d in sorted(set(r.dim) & PARALLEL)}


def for_model(sp: Spans, r: Rows) -> Spans:
    """The rank's spans as the data-parallel model reads them: comm spans that are not
    gradient units get the category `collective` (analyzed here, by kind)."""
    other = r.idx[~gradient_mask(sp, r)]
    if not other.size:
        return sp
    cats = list(sp.cats)
    if "collective" not in cats:
        cats.append("collective")
    cat = sp.cat.copy()
    cat[other] = cats.index("collective")
    return replace(sp, cat=cat, cats=cats, _mask_cache={})


def unit_kinds(sp: Spans, r: Rows, it_start: np.ndarray) -> dict[int, str]:
    """The kind of each gradient unit index (launch order within its iteration), as the
    data-parallel model numbers them: GPU comm records when there are any, else host spans."""
    if not r.n:
        return {}
    grad = gradient_mask(sp, r) & ~never_units(r)
    on_gpu = sp.device[r.idx] >= 0
    use = grad & (on_gpu if (grad & on_gpu).any() else ~on_gpu)
    j = np.flatnonzero(use)
    if not j.size:
        return {}
    t = sp.start[r.idx[j]]
    it = np.searchsorted(it_start, t, side="right") - 1
    order = np.lexsort((t, it))
    j, it = j[order], it[order]
    first = np.r_[0, np.flatnonzero(np.diff(it)) + 1]
    pos = np.arange(j.size) - np.repeat(first, np.diff(np.r_[first, j.size]))
    # per place the kind most of its units have (the first seen of those as many)
    out: dict[int, tuple[str, int]] = {}
    for (p, k), c in Counter(zip(pos.tolist(), [r.kind[x] for x in j.tolist()],
                                 strict=True)).items():
        if p not in out or c > out[p][1]:
            out[p] = (k, c)
    return {p: k for p, (k, _) in out.items()}
