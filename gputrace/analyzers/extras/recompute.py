"""Activation checkpointing: the forward recomputed inside the backward, a part of t_b.

The recorder writes each recomputed module call as a `recompute` span (collectors.torch.
recompute: a module forward run while autograd's backward ran on its thread). Traces of
earlier recorders wrote them as layer `forward` spans; those that began inside a backward
pass of the rank are taken as recomputes too (a layer's forward cannot begin inside the
backward otherwise). Neither is forward time: t_f leaves them out, t_b holds them, and the
recompute is the part of t_b they cover (on a GPU trace: the backward's device time of the
records launched in them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.frame import Spans

LARGE = 0.10     # of t_b: a recompute this large is named in the headline
SEC = 1e9


def spans(sp: Spans) -> np.ndarray:
    """Mask of the host spans that are a recomputed forward."""
    host = sp.device < 0
    m = sp.of("recompute") & host
    old = sp.of("forward") & (sp.layer >= 1) & host
    if old.any():
        outer = sp.of("backward") & (sp.layer < 0) & host & sp.lasting()
        if outer.any():
            u = ov.union(sp.start[outer], sp.end[outer])
            j = np.searchsorted(u[0], sp.start, side="right") - 1
            m |= old & (j >= 0) & (sp.start < u[1][np.maximum(j, 0)])
    return m


def _by_layer(sp: Spans, rec: np.ndarray) -> dict[int, np.ndarray]:
    ly = sp.layer[rec]
    return {int(k): rec & (sp.layer == k) for k in np.unique(ly[ly >= 1])}


def host(sp: Spans, rec: np.ndarray, bwd: ov.Union, lo: np.ndarray, hi: np.ndarray
         ) -> tuple[np.ndarray, list[dict[int, float]]]:
    """Per iteration, the recompute's time inside the backward's own work `bwd` (seconds),
    and each layer's."""
    n = lo.size
    keep = rec & sp.lasting()
    total = ov.measure(ov.intersect(ov.union(sp.start[keep], sp.end[keep]), bwd), lo, hi) / SEC
    layers: list[dict[int, float]] = [dict() for _ in range(n)]
    for ly, m in _by_layer(sp, keep).items():
        per = ov.measure(ov.intersect(ov.union(sp.start[m], sp.end[m]), bwd), lo, hi) / SEC
        for k in np.flatnonzero(per > 0):
            layers[int(k)][ly] = float(per[k])
    return total, layers


def launched_in(sp: Spans, rec: np.ndarray) -> np.ndarray:
    """Mask of the GPU records launched inside one of the spans `rec`."""
    keep = rec & sp.lasting()
    if not keep.any():
        return np.zeros(sp.start.size, dtype=bool)
    u = ov.union(sp.start[keep], sp.end[keep])
    t = sp.launch
    j = np.searchsorted(u[0], t, side="right") - 1
    return (t >= 0) & (j >= 0) & (t < u[1][np.maximum(j, 0)])


def gpu(sp: Spans, rec: np.ndarray, back: np.ndarray, group: np.ndarray, n: int
        ) -> tuple[np.ndarray, list[dict[int, float]]]:
    """Per iteration, the device time of the backward records (`back`) launched inside a
    recompute span, and each layer's."""
    def of(m: np.ndarray) -> np.ndarray:
        idx = np.flatnonzero(back & launched_in(sp, m))
        if not idx.size:
            return np.zeros(n)
        return ov.grouped_measure(sp.start[idx], sp.end[idx], group[idx], n) / SEC

    total = of(rec)
    layers: list[dict[int, float]] = [dict() for _ in range(n)]
    for ly, m in _by_layer(sp, rec).items():
        per = of(m)
        for k in np.flatnonzero(per > 0):
            layers[int(k)][ly] = float(per[k])
    return total, layers


@dataclass(frozen=True)
class LayerRecompute:
    layer: int
    name: str
    mean_s: float          # per analyzed iteration


@dataclass(frozen=True)
class Recompute:
    """The recomputed forward per analyzed iteration, a part of t_b; `unavailable`: why it
    is not known (then the figures are None)."""

    mean_s: float | None
    std_s: float | None
    share_of_t_b: float | None
    layers: tuple[LayerRecompute, ...] = ()
    unavailable: str | None = None

    @property
    def large(self) -> bool:
        """Over LARGE of t_b: named in the headline."""
        return self.share_of_t_b is not None and self.share_of_t_b > LARGE

    def as_dict(self) -> dict[str, Any]:
        return {"mean_s": self.mean_s, "std_s": self.std_s, "share_of_t_b": self.share_of_t_b,
                "large": self.large, "unavailable": self.unavailable,
                "layers": [{"layer": x.layer, "name": x.name, "recompute_s": x.mean_s}
                           for x in self.layers]}


NOT_WATCHED = ("not recorded: no recompute spans, and the trace does not say its recorder "
               "looked for them (gputrace's PyTorch collector does)")


def summarize(sp: Spans, per_it: np.ndarray | None, per_layer: list[dict[int, float]],
              t_b: np.ndarray, sel: np.ndarray) -> Recompute:
    """Means over the analyzed iterations `sel`; layer names from the layers' spans."""
    if per_it is None or not sel.size:
        return Recompute(None, None, None, unavailable="no analyzed iteration")
    v = per_it[sel]
    mean = float(v.mean())
    tb = float(t_b[sel].mean())
    names: dict[int, str] = {}
    m = np.flatnonzero((sp.layer >= 1) & (sp.device < 0) &
                       (sp.of("backward") | sp.of("forward") | sp.of("recompute")))
    for i in m[np.unique(sp.layer[m], return_index=True)[1]].tolist():
        names[int(sp.layer[i])] = sp.names[sp.name[i]]
    acc: dict[int, float] = {}
    for k in sel.tolist():
        for ly, s in per_layer[k].items():
            acc[ly] = acc.get(ly, 0.0) + s
    layers = tuple(LayerRecompute(ly, names.get(ly, "layer"), s / sel.size)
                   for ly, s in sorted(acc.items()))
    return Recompute(mean, float(v.std(ddof=1)) if v.size > 1 else 0.0,
                     mean / tb if tb > 0 else None, layers)


def seen(rc: Recompute | None, md: dict[str, Any]) -> Recompute | None:
    """The figure where it is known: a recompute was found, or the recorder watched for
    one (metadata `torch.recompute`: "watched", or why it could not)."""
    if rc is None or rc.unavailable or rc.mean_s or rc.layers:
        return rc
    said = {str(v) for v in _said(md)}
    if said == {"watched"}:
        return rc
    why = next(iter(sorted(said - {"watched"})), NOT_WATCHED)
    return Recompute(None, None, None, unavailable=why)


def _said(md: Any) -> list[Any]:
    """The `torch.recompute` of the trace's metadata and of each of its shards'."""
    if not isinstance(md, dict):
        return []
    out = []
    for m in [md, *(s for s in md.get("shards") or [] if isinstance(s, dict))]:
        v = (m.get("torch") or {}).get("recompute") if isinstance(m.get("torch"), dict) \
            else None
        if v is not None:
            out.append(v)
    return out

