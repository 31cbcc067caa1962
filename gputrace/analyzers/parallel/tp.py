"""Tensor parallelism: its collectives (DTensor's redistributions: the activations' all-reduce
or all-gather/reduce-scatter in the forward, their gradients' in the backward) per iteration,
per phase and per layer, the time the job stood in them (on the critical path by
construction: a layer's next matmul needs them; asynchronous TP overlapping a matmul is
hidden where no wait was recorded), and what another TP degree would give.

The what-if keeps the global batch and the model and changes the TP degree d -> d' (stated
as its assumptions): the compute of forward, backward and update splits evenly over the
TP ranks (x d/d'); each collective moves the same activation bytes (a Megatron block's
all-reduce is batch x sequence x hidden whatever the degree) at the bandwidth measured
here, a ring's 2(d'-1)/d' of them; the rest of the iteration (I/O, other dimensions' comm,
time in no phase) stays as measured."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gputrace.analyzers.core.collectives import Rows
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.parallel import whatif_bands as wb
from gputrace.analyzers.parallel.rows import rows_in

PHASES = ("forward", "backward", "update", "none")


@dataclass(frozen=True)
class Layer:
    layer: int
    name: str
    phase: str            # forward / backward
    count: float          # per iteration
    nbytes: float
    exposed_s: float


@dataclass(frozen=True)
class WhatIf:
    degree: int
    t_iter: float
    speedup: float        # over the measured degree's iteration
    compute_s: float
    comm_s: float


@dataclass(frozen=True)
class TensorParallel:
    degree: int
    mesh_dim: str
    count: float          # per analyzed iteration
    nbytes: float
    time_s: float         # the collectives' summed durations
    exposed_s: float      # the job's thread stood in them
    kinds: dict[str, dict[str, float]]      # kind -> count, bytes, exposed_s
    phases: dict[str, dict[str, float]]     # phase -> count, bytes, exposed_s
    layers: list[Layer] = field(default_factory=list)
    what_if: list[WhatIf] = field(default_factory=list)
    assumptions: tuple[str, ...] = ()

    @property
    def hidden_s(self) -> float:
        return max(self.time_s - self.exposed_s, 0.0)


ASSUMPTIONS = (
    "the global batch and the model stay; compute (forward, backward, update) splits "
    "evenly over the TP ranks (x d/d')",
    "each TP collective moves the same activation bytes, a ring's 2(d'-1)/d' of them, at "
    "the bandwidth measured here",
    "I/O, the other dimensions' comm and the time in no phase stay as measured")


def _stood_s(sp: Spans, r: Rows, j: np.ndarray) -> np.ndarray:
    """Per row of j, the seconds the job's thread stood in it (its issuing call and its
    wait, or a synchronous call in full; an asynchronous one nobody waited on: its call)."""
    out = np.zeros(j.size)
    has = r.wait_s[j] >= 0
    out[has] = (r.wait_e[j] - r.wait_s[j])[has] / 1e9
    sync = ~has & ~r.is_async[j]
    out[sync] = (sp.end[r.idx[j]] - sp.start[r.idx[j]])[sync] / 1e9
    call = r.call_s[j] >= 0
    out[call] += (r.call_e[j] - r.call_s[j])[call] / 1e9
    return out


def _layer_of(sp: Spans, cat: str, t: np.ndarray, tail: bool = False) -> np.ndarray:
    """For each time, the layer whose `cat` span (layer >= 1) holds it, -1 where none.
    `tail`: the layer whose span ended where the one holding it began (the layer before it
    in the same backward), where there is one."""
    m = np.flatnonzero(sp.of(cat) & (sp.layer >= 1) & (sp.device < 0))
    out = np.full(t.size, -1, np.int64)
    if not m.size or not t.size:
        return out
    m = m[np.argsort(sp.start[m], kind="stable")]
    k = np.searchsorted(sp.start[m], t, side="right") - 1
    ok = k >= 0
    inside = np.zeros(t.size, bool)
    inside[ok] = sp.end[m[k[ok]]] >= t[ok]
    if tail:
        prev = np.where(k > 0, k - 1, 0)
        tiled = inside & (k > 0) & (sp.end[m[prev]] == sp.start[m[np.maximum(k, 0)]])
        k = np.where(tiled, prev, k)
    out[inside] = sp.layer[m[k[inside]]]
    return out


def analyze(sp: Spans, r: Rows, it_start: np.ndarray, it_end: np.ndarray, sel: np.ndarray,
            terms: dict[str, np.ndarray]) -> TensorParallel | None:
    """The rank's tensor-parallel collectives over the analyzed iterations `sel`, or None
    when it has none."""
    j, _ = rows_in(sp, r, "tp", it_start, it_end, sel)
    if not j.size:
        return None
    t = sp.start[r.idx[j]]
    n_it = float(sel.size)
    nb = np.nan_to_num(r.nbytes[j])
    dur = (sp.end[r.idx[j]] - sp.start[r.idx[j]]) / 1e9
    stood = _stood_s(sp, r, j)
    kinds: dict[str, dict[str, float]] = {}
    phases: dict[str, dict[str, float]] = {}
    for i, b, s in zip(j.tolist(), nb.tolist(), stood.tolist(), strict=True):
        k, ph = r.kind[i], r.phase[i]
        for d, key in ((kinds, k), (phases, ph if ph in PHASES else "none")):
            e = d.setdefault(key, {"count": 0.0, "bytes": 0.0, "exposed_s": 0.0})
            e["count"] += 1 / n_it
            e["bytes"] += b / n_it
            e["exposed_s"] += s / n_it
    layers = _layers(sp, r, j, t, nb, stood, n_it)
    sizes = r.group_size[j]
    degree = int(np.max(sizes)) if (sizes > 0).any() else 0
    dims = [r.mesh_dim[i] for i in j.tolist() if r.mesh_dim[i]]
    out = TensorParallel(degree, max(set(dims), key=dims.count) if dims else "",
                         float(j.size) / n_it, float(nb.sum()) / n_it,
                         float(dur.sum()) / n_it, float(stood.sum()) / n_it, kinds, phases,
                         layers, assumptions=ASSUMPTIONS)
    return _with_what_if(out, {k: float(np.mean(v[sel])) for k, v in terms.items()})


def _layers(sp: Spans, r: Rows, j: np.ndarray, t: np.ndarray, nb: np.ndarray,
            stood: np.ndarray, n_it: float) -> list[Layer]:
    names: dict[int, str] = {}
    for cat in ("forward", "backward"):
        m = np.flatnonzero(sp.of(cat) & (sp.layer >= 1) & (sp.device < 0))
        for i in m[np.unique(sp.layer[m], return_index=True)[1]].tolist():
            names.setdefault(int(sp.layer[i]), sp.names[sp.name[i]])
    acc: dict[tuple[int, str], list[float]] = {}
    # A layer's backward span ends at its last parameter gradient (collectors.torch.grads);
    # its input's gradient comes after it, and the TP collective that carries it runs
    # before the next layer's compute, in the span that follows: the layer it belongs to is
    # the one whose span ended there. Under FSDP2 a layer's backward ends at FSDP's
    # post-backward, after its input's gradient: there the span holding it.
    tail = "fsdp2" not in r.fsdp
    for cat in ("forward", "backward"):
        sel = np.array([r.phase[i] == cat for i in j.tolist()], bool)
        ly = _layer_of(sp, cat, t[sel], tail and cat == "backward")
        for layer, b, s in zip(ly.tolist(), nb[sel].tolist(), stood[sel].tolist(),
                               strict=True):
            e = acc.setdefault((layer, cat), [0.0, 0.0, 0.0])
            e[0] += 1 / n_it
            e[1] += b / n_it
            e[2] += s / n_it
    return [Layer(ly, names.get(ly, "?" if ly < 0 else "layer"), ph, *v)
            for (ly, ph), v in sorted(acc.items(), key=lambda x: (x[0][1] != "forward",
                                                                  x[0][0]))]


def _with_what_if(tp: TensorParallel, t: dict[str, float]) -> TensorParallel:
    """Predicted iterations at other TP degrees (ASSUMPTIONS). Only where the breakdown has
    the `t_tp` term (a host timeline): on a GPU timeline the TP collectives' time is inside
    the phases' device time, not a term the prediction could take out and scale."""
    d = tp.degree
    if d < 2 or not t.get("t_iter") or "t_tp" not in t:
        return tp
    compute = t.get("t_f", 0.0) + t.get("t_b", 0.0) + t.get("t_u", 0.0)
    rest = t["t_iter"] - compute - t.get("t_tp", 0.0)
    ring = 2.0 * (d - 1) / d
    out = []
    for d2 in sorted({1, 2, 4, 8, d}):
        comm = 0.0 if d2 == 1 else tp.exposed_s * (2.0 * (d2 - 1) / d2) / ring
        c2 = compute * d / d2
        it = c2 + comm + rest
        out.append(WhatIf(d2, it, t["t_iter"] / it if it > 0 else 0.0, c2, comm))
    return replace(tp, what_if=out)


def as_dict(tp: TensorParallel) -> dict[str, Any]:
    """`--json`'s tensor_parallel section."""
    return {"degree": tp.degree, "mesh_dim": tp.mesh_dim, "count": tp.count,
            "bytes": tp.nbytes, "time_s": tp.time_s, "exposed_s": tp.exposed_s,
            "hidden_s": tp.hidden_s, "kinds": tp.kinds, "phases": tp.phases,
            "layers": [{("bytes" if k == "nbytes" else k): v for k, v in vars(x).items()}
                       for x in tp.layers],
            "what_if": [vars(w) | wb.band_keys(wb.kind_of_degree(w.degree, tp.degree))
                        for w in tp.what_if],
            "assumptions": list(tp.assumptions)}
