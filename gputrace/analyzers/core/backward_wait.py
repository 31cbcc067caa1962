"""DDP's wait for its gradient buckets at the backward's end, which no span of the job's
thread marks.

DDP all-reduces its buckets beside the backward (a span on the comm thread, from the bucket's
issue to its completion) and, at the backward's end, the autograd engine's final callback
waits for the last of them, then copies the reduced buckets back into the gradients: the
job's `backward()` returns only then. What the collective's span does not cover of that
wait (the job's thread waking up after the all-reduce ends, at times milliseconds beside a
busy neighbour, and DDP's copy back) is still the job standing still for its gradient sync,
as the job's own clock around `backward()` has it and as a job that times its wait from its
last gradient to `backward()` returning counts it (tests/test_moe.py, tests/test_trainers.py).

Such a row is given that wait: from the backward's last layer (or the collective's start,
if later) to the backward phase's end, when the collective was still in flight after the
backward's last layer, ran on another thread than the phase's and recorded no wait of its
own. A collective that ended under the layers (hidden) is given none: the instants after
the last layer are then DDP's own bookkeeping, in no phase."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gputrace.analyzers.core.comm_rows import Rows
from gputrace.analyzers.core.frame import Spans


def with_backward_waits(sp: Spans, r: Rows) -> Rows:
    """`r` with the implied waits above set (wait_s, wait_e) on the rows they hold for."""
    if not r.n:
        return r
    host = sp.device[r.idx] < 0
    cand = np.flatnonzero(~r.contract & host & (r.wait_s < 0))
    if not cand.size:
        return r
    bwd = sp.of("backward") & (sp.device < 0)
    ph = np.flatnonzero(bwd & (sp.layer < 0))
    if not ph.size:
        return r
    order = np.argsort(sp.start[ph], kind="stable")
    ph = ph[order]
    p_s, p_e = sp.start[ph], sp.end[ph]
    # each phase's last layer end (its per-layer spans start inside it); none: no wait known
    lay = np.flatnonzero(bwd & (sp.layer >= 1))
    last = np.full(ph.size, -1, np.int64)
    if lay.size:
        k = np.searchsorted(p_s, sp.start[lay], side="right") - 1
        ok = (k >= 0) & (sp.start[lay] < p_e[np.clip(k, 0, None)])
        np.maximum.at(last, k[ok], sp.end[lay][ok])
    ri = r.idx[cand]
    s, e = sp.start[ri], sp.end[ri]
    k = np.searchsorted(p_s, s, side="right") - 1
    kk = np.clip(k, 0, None)
    hold = (k >= 0) & (s < p_e[kk]) & (last[kk] >= 0) & (e > last[kk]) & \
        (sp.tid[ri] != sp.tid[ph[kk]])
    if not hold.any():
        return r
    ws, we = r.wait_s.copy(), r.wait_e.copy()
    j = cand[hold]
    ws[j] = np.maximum(s[hold], last[kk[hold]])
    we[j] = np.maximum(p_e[kk[hold]], ws[j])
    return replace(r, wait_s=ws, wait_e=we)
