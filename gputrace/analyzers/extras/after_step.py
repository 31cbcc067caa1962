"""The time after a training step's last recorded phase: from where its optimizer step (its
backward where no optimizer is patched; its data wait, copy, collective or the framework's
own work where one of those ran later) ended to the iteration's end, the next batch
request. An iteration that runs from one batch request to the next (a loop over a
DataLoader: its `io` span on the loop's thread begins where the iteration does) ends there,
so the logging after the step is in it; a job that sleeps there, writes a metric
synchronously or does any other work that nothing records stands still in its iteration's
time in no phase (the breakdown's `t_other`), no part of its training. analyzers.extras.goodput
takes it out of the training steps; the breakdown's terms, and t_iter, stay as they are (it
is the trailing part of `t_other`). An iteration that ends where its step returns
(PyTorch without a DataLoader, TensorFlow's custom loops: the next one opens there) has
none: what follows its step is at the next one's head, not told apart from that one's own
batch preparation.

What counts as a phase here: a forward, backward, update, host-to-device copy, collective
or framework span on any thread of the rank's process, a data wait (`io`) on the loop's
thread (a loader worker's prefetch is no work of the loop's), and any device record (a
kernel still running after the host's step: the loop's `loss.item()` waiting for it is the
step's)."""

from __future__ import annotations

import numpy as np

from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.frame import Spans

PHASES = ("forward", "backward", "update", "h2d", "comm", "framework")


def tails(sp: Spans, start: np.ndarray, end: np.ndarray, loop: tuple[int, int]
          ) -> ov.Union:
    """Each iteration's [last phase's end, its end] where that is inside it and it began
    at a batch request; an iteration in which no phase ran has none (nothing says where its
    work ended)."""
    n = start.size
    if not n:
        return ov.EMPTY
    pid, tid = loop
    m = np.zeros(sp.start.size, bool)
    for cat in PHASES:
        m |= sp.of(cat)
    wait = sp.of("io") & (sp.pid == pid) & (sp.tid == tid)
    m |= wait | (sp.device >= 0)
    requested = np.isin(start, sp.start[wait])
    idx = np.flatnonzero(m)
    # a span's iteration: the one its start lies in
    k = np.searchsorted(start, sp.start[idx], side="right") - 1
    ok = (k >= 0) & (sp.start[idx] < end[np.clip(k, 0, n - 1)])
    last = np.full(n, -1, np.int64)
    np.maximum.at(last, k[ok], np.maximum(sp.end[idx[ok]], sp.start[idx[ok]]))
    has = (last >= 0) & requested
    a = np.maximum(last[has], start[has])
    return ov.union(a, end[has])
