"""What if an expert-parallel group's routing were balanced: its all-to-alls replayed as
sync points.

Each all-to-all of the group starts for everyone when its last member enters it (`L`); a
member leaves it its own transfer later (`tau`: its exit less `L`, which on gloo grows with
what it receives), then works until it enters the next (`w`: its entry less its previous
exit). The replay keeps every measured `w` and `tau` but, at even loads, scales each
member's experts' compute (the `w` before the second of a dispatch/combine pair, forward and
backward) by the group's mean over its own of the bytes the all-to-all before it brought in
(the tokens its experts process in that layer, forward or backward: the compute taken as
proportional to them). What else the measured times hold (a rank descheduled, a slower
core) stays where it was, and so do the transfers (`tau`): on gloo a member's exit follows
no byte count the trace has (a combine that brings every member as many bytes back left
them 2-4 ms apart). Unchanged, the
replay is the measured run exactly; the saving is the group's last exit from its last
all-to-all, measured less replayed, per iteration (the mean over the iterations every
member shows whole)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gputrace.analyzers.parallel import whatif_bands as wb

# how far the what-if was from what it predicts, measured (analyzers.parallel.whatif_bands)
_EP = wb.KINDS["ep_balanced"]
BAND = (f"measured against {_EP.where}: off by {wb.text(_EP.band)} (each round's median; "
        f"{_EP.bench}, bench/README.md): the saving is within the machine's noise there")


def _steps(ent: dict[int, tuple[np.ndarray, ...]]) -> list[dict[int, np.ndarray]]:
    """The steps every member shows with the same all-to-alls (as many, dispatches and
    combines at the same places): per rank its rows in place order."""
    out = []
    for st in set.intersection(*(set(e[0].tolist()) for e in ent.values())):
        rows = {}
        for r, e in ent.items():
            x = np.flatnonzero(e[0] == st)
            rows[r] = x[np.argsort(e[1][x], kind="stable")]
        flags = [ent[r][5][x].tolist() for r, x in rows.items()]
        if flags[0] and all(f == flags[0] for f in flags):
            out.append(rows)
    return out


def _replay(start: np.ndarray, end: np.ndarray, w_scale: np.ndarray | None = None,
            tau_scale: np.ndarray | None = None) -> float:
    """The group's last exit from its last all-to-all (ns from the first entry), replayed
    on the measured work and transfers (members x all-to-alls), each scaled as given."""
    last = start.max(axis=0)
    tau = np.maximum(end - last, 0)
    w = np.zeros_like(start)
    w[:, 1:] = np.maximum(start[:, 1:] - end[:, :-1], 0)
    if w_scale is not None and tau_scale is not None:
        w, tau = w * w_scale, tau * tau_scale
    x = np.zeros(start.shape[0])
    for k in range(start.shape[1]):
        e = start[:, 0] - start[:, 0].min() if k == 0 else x + w[:, k]
        x = e.max() + tau[:, k]
    return float(x.max())


def saves_by_step(ranks: tuple[int, ...], parts: dict[int, Any], offsets: dict[int, int]
                  ) -> dict[int, float]:
    """Per step every member shows whole, the seconds its all-to-all section would be
    shorter at even loads ({} where the members' all-to-alls do not match)."""
    ent = {}
    for r in ranks:
        e = parts[r].entries
        if len(e) < 8:
            return {}
        ent[r] = (*e[:3], e[3] - offsets.get(r, 0), e[4] - offsets.get(r, 0), *e[5:])
    out: dict[int, float] = {}
    for rows in _steps(ent):
        first = rows[ranks[0]]
        start = np.array([ent[r][3][rows[r]] for r in ranks], float)
        end = np.array([ent[r][4][rows[r]] for r in ranks], float)
        got = np.array([ent[r][7][rows[r]] for r in ranks], float)
        expert = ent[ranks[0]][6][first].astype(bool)
        # the experts' compute before the k-th all-to-all processes the tokens the (k-1)-th
        # brought in (a dispatch, or a combine's gradient): each member's at the mean
        w_scale = np.ones_like(start)
        k = np.flatnonzero(expert)
        brought = got[:, k - 1]
        if (brought <= 0).any():
            continue
        w_scale[:, k] = brought.mean(axis=0) / brought
        base = float(np.max(end[:, -1]) - start[:, 0].min())
        if abs(_replay(start, end) - base) > 1e3:   # 1 us: not the run itself
            continue
        out[int(ent[ranks[0]][0][first[0]])] = \
            (base - _replay(start, end, w_scale, np.ones_like(start))) / 1e9
    return out


def balanced_saves(ranks: tuple[int, ...], parts: dict[int, Any], offsets: dict[int, int]
                   ) -> tuple[float, int]:
    """(seconds per iteration the group's all-to-all section would be shorter at even
    loads, iterations replayed); (nan, 0) where the members' all-to-alls do not match."""
    by = saves_by_step(ranks, parts, offsets)
    if not by:
        return float("nan"), 0
    return float(np.mean(list(by.values()))), len(by)
