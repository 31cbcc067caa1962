"""Expert parallelism: the all-to-alls of mixture-of-experts layers (tokens dispatched to
their experts, the experts' outputs combined back; in the backward, their gradients the
other way), per iteration and phase, the bytes to each peer (by global rank), the time the
job stood in them, and, per expert-parallel group, the imbalance: the most-loaded rank's
tokens (rows received in dispatch, from the split sizes) and bytes over the group's mean.

Which all-to-all is a dispatch and which a combine is read from what they move, per
iteration and phase: an all-to-all of integers (args.integer: the per-expert token counts
a MoE layer exchanges before it dispatches) is a count exchange; the others pair up, a
combine moving back exactly the bytes its dispatch moved (its input bytes the dispatch's
output bytes and the other way round). In the forward the first of a pair is the dispatch
(before the experts' compute), the second the combine; in the backward the combine's
gradient runs first, then the dispatch's. An all-to-all no later one pairs with is
`unpaired` (no role: nothing says which it is). A layer's capacity all-reduce before its
dispatch (capacity.py) is `capacity`: its bytes, time and wait count with the all-to-alls'.

Tokens come from the dispatches' split sizes (args.splits). A dispatch given none
(args.even: its first dimension cut evenly, DeepSpeed-MoE's capacity-padded [experts,
capacity, model] buffers, whose first dimension is experts, not tokens) says nothing of the
tokens routed: `even_splits`, and the imbalance is in bytes alone."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.analyzers.core.collectives import Rows
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.parallel import whatif_bands as wb
from gputrace.analyzers.parallel.ep import ep_whatif
from gputrace.analyzers.parallel.rows import rows_in
from gputrace.analyzers.parallel.tp import _stood_s

FIRST_SECOND = {"forward": ("dispatch", "combine"), "backward": ("combine", "dispatch")}


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
    roles_backward: dict[str, dict[str, float]] = field(default_factory=dict)
    peer_ranks: list[int] = field(default_factory=list)  # the global rank of each peer
    group: tuple[int, ...] = ()         # the expert-parallel group's global ranks
    dispatch_rows: dict[int, float] = field(default_factory=dict)  # rows sent to each
    # the experts' compute: between each dispatch's end and its combine's start (forward),
    # the combine's gradient's end and the dispatch's gradient's start (backward)
    expert_s: float = 0.0
    # each all-to-all's entry, to match the group's members: (step, its place among the
    # iteration's all-to-alls, its MoE layer (0: none known), start and end ns, own clock,
    # 1 where it is a dispatch or combine, 1 where the experts' compute ran just before it:
    # the second of a pair that follows its first, the bytes it received)
    entries: tuple[np.ndarray, ...] = ()
    iterations: int = 0
    # every forward dispatch moved even splits (no split sizes given): capacity-padded
    # buffers, whose rows are no tokens (dispatch_rows then empty)
    even_splits: bool = False
    # per iteration, the capacity all-reduces before the dispatches (capacity.py: DeepSpeed-
    # MoE's drop_tokens=False); `count` is the all-to-alls', the other figures hold both
    capacity: float = 0.0


def _args(sp: Spans, r: Rows, j: np.ndarray) -> list[dict[str, Any]]:
    out = []
    for a in sp.args.take(pa.array(r.idx[j])).to_pylist():
        try:
            d = json.loads(a or "{}")
        except ValueError:
            d = {}
        out.append(d if isinstance(d, dict) else {})
    return out


def _pair(rows: list[int], nin: np.ndarray, nout: np.ndarray) -> list[tuple[int, int]]:
    """Pairs (first, second) of positions in `rows` (time order) where the second moves
    back what the first moved: the nearest later unpaired one with swapped bytes (where
    either's output bytes are unknown, as many input bytes)."""
    used: set[int] = set()
    pairs = []
    for x, i in enumerate(rows):
        if i in used:
            continue
        for k in rows[x + 1:]:
            back = nin[k] == nin[i] if nout[i] <= 0 or nout[k] <= 0 else \
                nin[k] == nout[i] and nout[k] == nin[i]
            if k not in used and back and nin[i] > 0:
                used.update((i, k))
                pairs.append((i, k))
                break
    return pairs


def analyze(sp: Spans, r: Rows, it_start: np.ndarray, it_end: np.ndarray,
            sel: np.ndarray, steps: np.ndarray | None = None) -> ExpertParallel | None:
    j, it = rows_in(sp, r, "ep", it_start, it_end, sel)
    if not j.size:
        return None
    n_it = float(sel.size)
    order = np.lexsort((sp.start[r.idx[j]], it))
    j, it = j[order], it[order]
    nb = np.nan_to_num(r.nbytes[j])
    nout = np.nan_to_num(r.bytes_out[j])
    stood = _stood_s(sp, r, j)
    dur = (sp.end[r.idx[j]] - sp.start[r.idx[j]]) / 1e9
    args = _args(sp, r, j)
    # the role of each row (position in j): counts, dispatch, combine, unpaired
    role = ["unpaired"] * j.size
    layer = np.zeros(j.size, np.int64)
    layers: dict[int, int] = {}
    groups: dict[tuple[int, str], list[int]] = {}
    n_counts: dict[int, int] = {}
    n_cap: dict[int, int] = {}
    kind = [r.kind[i] for i in j.tolist()]
    for x in range(j.size):
        if kind[x] == "all_reduce":      # a layer's capacity agreed (capacity.py)
            role[x] = "capacity"
            n_cap[int(it[x])] = layer[x] = n_cap.get(int(it[x]), 0) + 1
        elif args[x].get("integer"):
            role[x] = "counts"
            if r.phase[j[x]] == "forward":   # one per layer, before its dispatch
                n_counts[int(it[x])] = layer[x] = n_counts.get(int(it[x]), 0) + 1
        else:
            groups.setdefault((int(it[x]), r.phase[j[x]] or "none"), []).append(x)
    expert_ns = 0
    after = np.zeros(j.size, np.int64)
    for (k, ph), xs in groups.items():
        if ph not in FIRST_SECOND:
            continue
        pairs = _pair(xs, nb, nout)
        for n, (a, b) in enumerate(pairs):
            role[a], role[b] = FIRST_SECOND[ph]
            # the backward runs the layers last to first
            layer[a] = layer[b] = n + 1 if ph == "forward" else len(pairs) - n
            after[b] = int(b == a + 1)
            gap = sp.start[r.idx[j[b]]] - sp.end[r.idx[j[a]]]
            expert_ns += max(int(gap), 0)
        if ph == "forward":
            layers[k] = len(pairs)
    phases: dict[str, dict[str, float]] = {}
    roles: dict[str, dict[str, float]] = {}
    roles_bwd: dict[str, dict[str, float]] = {}
    for x, (b, s) in enumerate(zip(nb.tolist(), stood.tolist(), strict=True)):
        ph = r.phase[j[x]] or "none"
        targets = [phases.setdefault(ph, {"count": 0.0, "bytes": 0.0, "exposed_s": 0.0})]
        if ph == "forward":
            targets.append(roles.setdefault(role[x], {"count": 0.0, "bytes": 0.0,
                                                      "exposed_s": 0.0}))
        elif ph == "backward":
            targets.append(roles_bwd.setdefault(role[x], {"count": 0.0, "bytes": 0.0,
                                                          "exposed_s": 0.0}))
        for e in targets:
            e["count"] += 1 / n_it
            e["bytes"] += b / n_it
            e["exposed_s"] += s / n_it
    sizes = r.group_size[j]
    members = [g for g in (r.group_ranks[i] for i in j.tolist()) if g] \
        if r.group_ranks else []
    group = tuple(max(members, key=len)) if members else ()
    peers = _peers(args, n_it)
    ranks = list(group) if len(group) == len(peers) else list(range(len(peers)))
    rows_to: dict[int, float] = {}
    dispatches = [x for x in range(j.size)
                  if role[x] == "dispatch" and r.phase[j[x]] == "forward"]
    even = bool(dispatches) and all(args[x].get("even") is True for x in dispatches)
    for x in dispatches:
        sp_ = args[x].get("splits")
        if isinstance(sp_, list) and args[x].get("even") is not True:
            for q, n in enumerate(sp_):
                g = ranks[q] if q < len(ranks) else q
                rows_to[g] = rows_to.get(g, 0.0) + float(n) / n_it
    # the step numbers match the members' iterations; where some are unknown (-1) or
    # repeat, the iteration's place among the analyzed ones
    known = steps is not None and steps.size > int(sel.max()) and \
        (steps[sel] >= 0).all() and np.unique(steps[sel]).size == sel.size
    step = (steps[it] if known else np.searchsorted(np.sort(sel), it)).astype(np.int64)
    first = np.r_[True, it[1:] != it[:-1]]
    place = np.arange(j.size) - np.maximum.accumulate(np.where(first, np.arange(j.size), 0))
    entries = (step, place, layer, sp.start[r.idx[j]].astype(np.int64),
               sp.end[r.idx[j]].astype(np.int64),
               np.array([x in ("dispatch", "combine") for x in role], np.int64), after,
               np.where(nout > 0, nout, nb).astype(np.int64))
    a2a = sum(k == "all_to_all" for k in kind)
    return ExpertParallel(sp.rank, int(sizes.max()) if (sizes > 0).any() else 0,
                          float(a2a) / n_it, float(nb.sum()) / n_it,
                          float(stood.sum()) / n_it, float(dur.sum()) / n_it, phases, roles,
                          peers, max(layers.values(), default=0), roles_bwd, ranks, group,
                          rows_to, expert_ns / 1e9 / n_it, entries, int(n_it), even,
                          float(j.size - a2a) / n_it)


def _peers(args: list[dict[str, Any]], n_it: float) -> list[float]:
    """Bytes to each peer of the group per iteration (args.peers), [] when not recorded."""
    out: list[float] = []
    for a in args:
        p = a.get("peers")
        if not isinstance(p, list):
            continue
        if len(out) < len(p):
            out += [0.0] * (len(p) - len(out))
        for i, b in enumerate(p):
            out[i] += float(b) / n_it
    return out


@dataclass(frozen=True)
class GroupImbalance:
    """One expert-parallel group: each rank's all-to-all bytes and the tokens its experts
    received in dispatch (rows, from every member's split sizes), per iteration."""

    ranks: tuple[int, ...]
    bytes_by_rank: dict[int, float]
    ratio: float              # the most-loaded rank's bytes over the group's mean
    most_loaded: int          # by tokens where known, else by bytes
    tokens_by_rank: dict[int, float] = field(default_factory=dict)
    tokens_ratio: float = float("nan")   # the most-loaded rank's tokens over the mean
    # what if routing were balanced (every rank the group's mean tokens): the all-to-alls
    # replayed with the experts' compute and the transfers at the group's mean
    # (ep_whatif), seconds per iteration
    balanced_saves_s: float = float("nan")
    most_expert_s: float = 0.0     # the most-loaded rank's expert compute per iteration
    # per rank, per iteration: the time it waited in its all-to-alls for the group's last
    # member to enter them (the last one's entry less its own, at most its own span), in
    # all and per MoE layer (0: an all-to-all of no known layer)
    wait_s: dict[int, float] = field(default_factory=dict)
    wait_by_layer: dict[int, dict[int, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Imbalance:
    """Across the ranks, per expert-parallel group (never pooled across groups): the
    fields of the group whose most-loaded rank is furthest over its mean (1.0: balanced),
    and every group in `groups`."""

    bytes_by_rank: dict[int, float]
    ratio: float
    most_loaded: int
    groups: list[GroupImbalance] = field(default_factory=list)
    tokens_ratio: float = float("nan")


def _waits(ranks: tuple[int, ...], parts: dict[int, ExpertParallel],
           offsets: dict[int, int]) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """Per rank of the group, its wait for the last member to enter each all-to-all they
    all show (matched by step and place in the iteration), per iteration, in all and per
    MoE layer; nothing where the members' all-to-alls do not match."""
    ent = {r: parts[r].entries for r in ranks if parts[r].entries}
    if len(ent) != len(ranks):
        return {}, {}
    keys = {r: {(int(s), int(p)): x for x, (s, p) in enumerate(zip(e[0], e[1], strict=True))}
            for r, e in ent.items()}
    common = set.intersection(*(set(k) for k in keys.values()))
    if not common:
        return {}, {}
    wait: dict[int, float] = {r: 0.0 for r in ranks}
    by_layer: dict[int, dict[int, float]] = {r: {} for r in ranks}
    for key in common:
        start = {r: int(ent[r][3][keys[r][key]]) - offsets.get(r, 0) for r in ranks}
        last = max(start.values())
        for r in ranks:
            x = keys[r][key]
            w = min(last - start[r], int(ent[r][4][x] - ent[r][3][x])) / 1e9
            n = max(parts[r].iterations, 1)
            wait[r] += w / n
            lay = int(ent[r][2][x])
            by_layer[r][lay] = by_layer[r].get(lay, 0.0) + w / n
    return wait, by_layer


def _group(ranks: tuple[int, ...], parts: dict[int, ExpertParallel],
           offsets: dict[int, int] | None = None) -> GroupImbalance:
    by = {r: parts[r].nbytes for r in ranks}
    mean = float(np.mean(list(by.values())))
    tok: dict[int, float] = {}
    for r in ranks:
        for g, n in parts[r].dispatch_rows.items():
            tok[g] = tok.get(g, 0.0) + n
    tok = {g: n for g, n in tok.items() if g in by}
    if len(tok) == len(by) and sum(tok.values()) > 0:
        most = max(tok, key=lambda r: tok[r])
        tr = tok[most] / float(np.mean(list(tok.values())))
    else:
        tok, tr = {}, float("nan")
        most = max(by, key=lambda r: by[r])
    top = max(by.values())
    # even splits (capacity-padded buffers): every rank's experts process as much whatever
    # the routing; what balance changes (tokens dropped, a capacity set by the most-loaded
    # expert) the comm does not show, so nothing is predicted
    saves = float("nan") if all(parts[r].even_splits for r in ranks) else \
        ep_whatif.balanced_saves(ranks, parts, offsets or {})[0]
    wait, by_layer = _waits(ranks, parts, offsets or {})
    return GroupImbalance(ranks, by, top / mean if mean > 0 else 1.0, most, tok, tr, saves,
                          parts[most].expert_s, wait, by_layer)


def imbalance(parts: dict[int, ExpertParallel],
              offsets: dict[int, int] | None = None) -> Imbalance | None:
    if len(parts) < 2:
        return None
    keyed: dict[tuple[int, ...], list[int]] = {}
    for r, p in parts.items():
        g = p.group if p.group and r in p.group else tuple(sorted(parts))
        keyed.setdefault(tuple(sorted(g)), []).append(r)
    groups = [_group(tuple(sorted(rs)), parts, offsets) for rs in keyed.values()
              if len(rs) >= 2]
    if not groups:
        return None
    worst = max(groups, key=lambda g: g.tokens_ratio if g.tokens_by_rank else g.ratio)
    by = {r: p.nbytes for r, p in parts.items()}
    return Imbalance(by, worst.ratio, worst.most_loaded, groups, worst.tokens_ratio)


def _finite(x: float) -> float | None:
    """A figure for --json: null where there is none (NaN: withheld, or not told)."""
    return float(x) if np.isfinite(x) else None


def as_dict(ep: ExpertParallel, imb: Imbalance | None) -> dict[str, Any]:
    """`--json`'s expert_parallel section."""
    d: dict[str, Any] = {("bytes" if k == "nbytes" else k): v for k, v in vars(ep).items()
                         if k not in ("entries", "iterations")}
    d["group"] = list(ep.group)
    d["dispatch_rows"] = {str(k): v for k, v in ep.dispatch_rows.items()}
    if imb is not None:
        d["imbalance"] = {"ratio": imb.ratio, "most_loaded_rank": imb.most_loaded,
                          "bytes_by_rank": {str(k): v for k, v in imb.bytes_by_rank.items()},
                          "tokens_ratio": _finite(imb.tokens_ratio),
                          "groups": [{"ranks": list(g.ranks), "ratio": g.ratio,
                                      "most_loaded_rank": g.most_loaded,
                                      "tokens_ratio": _finite(g.tokens_ratio),
                                      "balanced_saves_s": _finite(g.balanced_saves_s),
                                      # no band beside a what-if withheld
                                      **wb.band_keys("ep_balanced" if _finite(
                                          g.balanced_saves_s) is not None else None),
                                      "most_loaded_expert_s": g.most_expert_s,
                                      "wait_s": {str(k): v for k, v in g.wait_s.items()},
                                      "wait_by_layer": {
                                          str(k): {str(n): w for n, w in v.items()}
                                          for k, v in g.wait_by_layer.items()},
                                      "bytes_by_rank": {str(k): v for k, v in
                                                        g.bytes_by_rank.items()},
                                      "tokens_by_rank": {str(k): v for k, v in
                                                         g.tokens_by_rank.items()}}
                                     for g in imb.groups]}
    return d
