"""The phases of a PyTorch loop from the order of its operators, for traces that do not name
forward and backward (torch.profiler without module ranges)."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from gputrace.importers import repeats as rp

# What a host range is, for finding forward and backward in traces that do not name them
# (torch.profiler without module ranges): kinds of ranges on a thread.
OP, IO, UPDATE, ZERO_GRAD, BACKWARD, COPY, STEP = range(7)
_COPY_OPS = frozenset(("aten::to", "aten::_to_copy", "aten::copy_", "aten::pin_memory",
                       "aten::_pin_memory", "cudaMemcpyAsync", "aten::empty_like"))


def op_kind(name: str, phase: str | None) -> int:
    """The kind of a host range (see OP ... STEP) from its name and phase_of's answer."""
    if phase == "iteration":
        return STEP
    if phase == "io":
        return IO
    if phase == "update":
        return UPDATE
    if phase == "backward":
        return BACKWARD
    if name.startswith("Optimizer.zero_grad"):
        return ZERO_GRAD
    if name in _COPY_OPS:
        return COPY
    return OP


class HostOps:
    """The host ranges of a trace as flat arrays (pid, tid, start, end, kind, name code),
    kept while a file is parsed to find the loop's forward and backward passes, and where
    the file marks none its iterations, afterwards."""

    def __init__(self) -> None:
        self.data = array("q")
        self.names: dict[str, int] = {}

    def code(self, name: str) -> int:
        return self.names.setdefault(name, len(self.names))

    def add(self, pid: int, tid: int, start: int, end: int, kind: int, name: int) -> None:
        self.data.extend((pid, tid, start, end, kind, name))

    def repeats(self, loops: dict[int, Any]) -> dict[Any, rp.Repeats]:
        """For each process of `loops`, the iterations of its loop's thread from what its
        top-level ranges repeat (for a file without iteration marks)."""
        if not self.data:
            return {}
        a = np.frombuffer(self.data, np.int64).reshape(-1, 6)
        names = list(self.names)
        out = {}
        for pid in loops:
            mine = a[a[:, 0] == pid]
            # the loop's thread: the one that waits for batches, steps the optimizer or
            # zeroes the gradients, else the one of most ops
            own = mine[np.isin(mine[:, 4], (IO, UPDATE, ZERO_GRAD))]
            tids, n = np.unique((own if len(own) else mine)[:, 1], return_counts=True)
            key = (int(pid), int(tids[int(np.argmax(n))]))
            t = mine[mine[:, 1] == key[1]]
            top = rp.top_level(t[:, 2], t[:, 3])
            rep = rp.find([names[c] for c in t[top, 5].tolist()], t[top, 2], t[top, 3])
            if rep is not None:
                out[key] = rep
        return out

    def infer(self, loops: dict[int, Any]) -> list[tuple[Any, int, int, str]]:
        """Forward and backward ranges on each process's loop thread, from the order of its
        operators: a backward pass is a run of autograd's backward functions (on any thread
        of the process); its forward runs on the loop thread from the first operator after
        the last batch wait, optimizer call, backward pass or iteration start (leading
        copies of the batch excluded) to the backward's start. Returns (key, start, end,
        cat) with key = the loop's (pid, tid)."""
        if not self.data or not loops:
            return []
        a = np.frombuffer(self.data, np.int64).reshape(-1, 6)
        out: list[tuple[Any, int, int, str]] = []
        for pid, key in loops.items():
            mine = a[a[:, 0] == pid]
            bwd = mine[mine[:, 4] == BACKWARD]
            own = mine[mine[:, 1] == key[1]]
            # top-level ranges of the loop thread (a range inside another is part of it);
            # iteration ranges enclose everything and only mark boundaries
            steps = own[own[:, 4] == STEP]
            own = own[own[:, 4] != STEP]
            own = own[np.lexsort((-own[:, 3], own[:, 2]))]
            top = np.ones(len(own), dtype=bool)
            if len(own):
                reach = np.maximum.accumulate(own[:, 3])
                top[1:] = own[1:, 2] >= reach[:-1]
            own = own[top & (own[:, 4] != BACKWARD)]
            marks = [(int(s), int(e), int(k)) for s, e, k in own[:, 2:5].tolist()]
            marks += [(int(s), int(s), STEP) for s in steps[:, 2].tolist()]
            marks += [(int(s), int(e), BACKWARD) for s, e in bwd[:, 2:4].tolist()]
            marks.sort()
            first: int | None = None     # the forward's first operator
            run: list[int] | None = None  # [start, end] of the backward pass being read
            for s, e, k in marks:
                if k == BACKWARD:
                    if run is None:
                        if first is not None:
                            out.append((key, first, s, "forward"))
                        run, first = [s, e], None
                    else:
                        run[1] = max(run[1], e)
                    continue
                if run is not None:
                    if s < run[1]:
                        continue           # the loop thread's own work inside the pass
                    out.append((key, run[0], run[1], "backward"))
                    run = None
                if k in (IO, UPDATE, ZERO_GRAD, STEP):
                    first = None
                elif k == OP and first is None:
                    first = s
            if run is not None:
                out.append((key, run[0], run[1], "backward"))
        return out
