"""A MoE layer's capacity all-reduce: DeepSpeed-MoE with `drop_tokens=False` agrees the
capacity of its experts' buffers before each dispatch, the most-loaded expert's token
count all-reduced (MAX) over the expert-parallel group (`deepspeed.moe.sharded_moe`'s
gating). It carries a count, not activations nor gradients, and it is the layer's first
collective: the group's last rank to reach the layer is waited for there.

Told from what it carries, where it runs and its group: an all-reduce of a few bytes in
the forward, on the group of the rank's expert-parallel all-to-alls, whose next collective
on that group is one of those all-to-alls. Any other small all-reduce keeps its reading."""

from __future__ import annotations

import numpy as np

CAPACITY_BYTES = 64        # a count or a few: an int64 scalar is 8


def capacity_rows(start: np.ndarray, kinds: list[str], contract: np.ndarray,
                  phase: list[str], groups: list[tuple[int, ...] | None],
                  nbytes: np.ndarray, told: list[tuple[str, str]]) -> np.ndarray:
    """Per comm row (in row order), whether it is a capacity all-reduce (above)."""
    out = np.zeros(len(kinds), bool)
    ep_a2a = np.array([d == "ep" and k == "all_to_all" for (d, _), k in
                       zip(told, kinds, strict=True)], bool)
    ep_groups = {groups[i] for i in np.flatnonzero(ep_a2a).tolist() if groups[i]}
    if not ep_groups:
        return out
    order = np.argsort(start, kind="stable").tolist()
    nxt: dict[tuple[int, ...], int] = {}      # per group, the next row after the one seen
    for i in reversed(order):                 # latest first: each row sees the next on its group
        g = groups[i]
        if g not in ep_groups:
            continue
        j = nxt.get(g)
        out[i] = bool(j is not None and ep_a2a[j] and phase[j] == "forward"
                      and contract[i] and kinds[i] == "all_reduce"
                      and phase[i] == "forward" and nbytes[i] <= CAPACITY_BYTES)
        nxt[g] = i
    return out
