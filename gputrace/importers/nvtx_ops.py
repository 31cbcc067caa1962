"""The NVTX ranges of an import, kept while it is read: the phase of autograd's `emit_nvtx`
op ranges, and the iterations of a process without iteration marks from what its loop
thread repeats."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from gputrace.importers import repeats as rp


class NvtxOps:
    """Ranges with an end, in start order, one `add` each."""

    def __init__(self) -> None:
        self.data = array("q")           # pid, tid, start, end, name code
        self.codes: dict[str, int] = {}
        self.seq_ops = 0                 # emit_nvtx ranges with a sequence number
        self._backward: dict[Any, list[int]] = {}   # thread -> ends of open backward ranges

    def add(self, key: tuple[int, int], start: int, end: int, name: str, phase: str | None,
            seq: int | None) -> str | None:
        """Note a range; return its phase. An `emit_nvtx` op with a sequence number and no
        phase of its own ran where autograd records (grad mode): a forward op, or, inside a
        backward range of its thread, a recomputation that the backward ran (activation
        checkpointing): backward."""
        code = self.codes.setdefault(name, len(self.codes))
        self.data.extend((key[0], key[1], start, end, code))
        if seq is not None:
            self.seq_ops += 1
        open_ = self._backward.setdefault(key, [])
        while open_ and open_[-1] <= start:
            open_.pop()
        if phase is None and seq is not None:
            phase = "backward" if open_ else "forward"
        if phase == "backward":
            open_.append(end)
            open_.sort(reverse=True)
        return phase

    def repeats(self, marked: set[Any]) -> dict[tuple[int, int], rp.Repeats]:
        """For each process with no iteration range on any thread (`marked`: threads that
        have some), the repeats of its busiest thread's top-level ranges, where they
        repeat."""
        if not self.data:
            return {}
        a = np.frombuffer(self.data, np.int64).reshape(-1, 5)
        names = list(self.codes)
        done = {k[0] for k in marked}
        out: dict[tuple[int, int], rp.Repeats] = {}
        for pid in np.unique(a[:, 0]).tolist():
            if pid in done:
                continue
            mine = a[a[:, 0] == pid]
            tids, n = np.unique(mine[:, 1], return_counts=True)
            tid = int(tids[int(np.argmax(n))])
            t = mine[mine[:, 1] == tid]
            top = rp.top_level(t[:, 2], t[:, 3])
            rep = rp.find([names[c] for c in t[top, 4].tolist()], t[top, 2], t[top, 3])
            if rep is not None:
                out[(int(pid), tid)] = rep
        return out
