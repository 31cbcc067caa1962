"""Expert parallelism: the all-to-alls of mixture-of-experts layers (tokens dispatched to
their experts, the experts' outputs combined back; in the backward, their gradients the
other way), per iteration and phase, the bytes to each peer, the time the job stood in them,
and, across the ranks, the imbalance: the most-loaded rank's bytes over the mean.

Which all-to-all is a dispatch and which a combine is read from their order in the forward
(a MoE layer dispatches, then combines): the 1st, 3rd, ... of an iteration's forward are
dispatches of MoE layers 1, 2, ..., the 2nd, 4th, ... their combines."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.analyzers.collectives import Rows
from gputrace.analyzers.frame import Spans
from gputrace.analyzers.parallel.rows import rows_in
from gputrace.analyzers.parallel.tp import _stood_s


@dataclass(frozen=True)
class ExpertParallel:
    """One rank's expert-parallel all-to-alls, per analyzed iteration."""

    rank: int
    degree: int
    count: float
    nbytes: float             # this rank's input bytes
    exposed_s: float
    time_s: float
    phases: dict[str, dict[str, float]]
    roles: dict[str, dict[str, float]]   # dispatch / combine (forward) -> count, bytes, s
    peers: list[float] = field(default_factory=list)   # bytes to each peer per iteration
    moe_layers: int = 0


def analyze(sp: Spans, r: Rows, it_start: np.ndarray, it_end: np.ndarray,
            sel: np.ndarray) -> ExpertParallel | None:
    j, it = rows_in(sp, r, "ep", it_start, it_end, sel)
    if not j.size:
        return None
    n_it = float(sel.size)
    order = np.lexsort((sp.start[r.idx[j]], it))
    j, it = j[order], it[order]
    nb = np.nan_to_num(r.nbytes[j])
    stood = _stood_s(sp, r, j)
    dur = (sp.end[r.idx[j]] - sp.start[r.idx[j]]) / 1e9
    phases: dict[str, dict[str, float]] = {}
    roles: dict[str, dict[str, float]] = {}
    fwd_pos: dict[int, int] = {}
    for i, k, b, s in zip(j.tolist(), it.tolist(), nb.tolist(), stood.tolist(), strict=True):
        ph = r.phase[i] or "none"
        e = phases.setdefault(ph, {"count": 0.0, "bytes": 0.0, "exposed_s": 0.0})
        e["count"] += 1 / n_it
        e["bytes"] += b / n_it
        e["exposed_s"] += s / n_it
        if ph == "forward":
            pos = fwd_pos.get(k, 0)
            fwd_pos[k] = pos + 1
            role = "dispatch" if pos % 2 == 0 else "combine"
            e = roles.setdefault(role, {"count": 0.0, "bytes": 0.0, "exposed_s": 0.0})
            e["count"] += 1 / n_it
            e["bytes"] += b / n_it
            e["exposed_s"] += s / n_it
    sizes = r.group_size[j]
    return ExpertParallel(sp.rank, int(sizes.max()) if (sizes > 0).any() else 0,
                          float(j.size) / n_it, float(nb.sum()) / n_it,
                          float(stood.sum()) / n_it, float(dur.sum()) / n_it, phases, roles,
                          _peers(sp, r, j, n_it),
                          int(round(max(fwd_pos.values(), default=0) / 2)))


def _peers(sp: Spans, r: Rows, j: np.ndarray, n_it: float) -> list[float]:
    """Bytes to each peer of the group per iteration (args.peers), [] when not recorded."""
    out: list[float] = []
    for a in sp.args.take(pa.array(r.idx[j])).to_pylist():
        try:
            p = json.loads(a or "{}").get("peers")
        except (ValueError, AttributeError):
            p = None
        if not isinstance(p, list):
            continue
        if len(out) < len(p):
            out += [0.0] * (len(p) - len(out))
        for i, b in enumerate(p):
            out[i] += float(b) / n_it
    return out


@dataclass(frozen=True)
class Imbalance:
    """Across the ranks: each one's all-to-all bytes per iteration, the most-loaded over
    the mean (1.0: balanced)."""

    bytes_by_rank: dict[int, float]
    ratio: float
    most_loaded: int


def imbalance(parts: dict[int, ExpertParallel]) -> Imbalance | None:
    if len(parts) < 2:
        return None
    by = {r: p.nbytes for r, p in parts.items()}
    mean = float(np.mean(list(by.values())))
    most = max(by, key=lambda r: by[r])
    return Imbalance(by, by[most] / mean if mean > 0 else 1.0, most)


def as_dict(ep: ExpertParallel, imb: Imbalance | None) -> dict[str, Any]:
    """`--json`'s expert_parallel section."""
    d = {("bytes" if k == "nbytes" else k): v for k, v in vars(ep).items()}
    if imb is not None:
        d["imbalance"] = {"ratio": imb.ratio, "most_loaded_rank": imb.most_loaded,
                          "bytes_by_rank": {str(k): v for k, v in imb.bytes_by_rank.items()}}
    return d
