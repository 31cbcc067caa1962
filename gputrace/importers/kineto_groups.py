"""The process group of each imported NCCL kernel, where the Kineto trace says it.

PyTorch's profiler records a collective's process group on its `record_param_comms` CPU op
(NCCL's ProcessGroup fills it in; gloo's records no such op) and, in recent versions, on
the NCCL kernel itself: `Process Group Name` ("0", "3"), `Process Group Description`
(`default_pg`, a DeviceMesh dimension's `mesh_tp`, or the `group_desc` given to
`new_group`), `Process Group Ranks` (a list as text, "[0, 1]") and `Group size`. A kernel
that carries none of them takes those of the `record_param_comms` op of the same
`External id` (the op that launched it). The kernel's comm row then gets the args the
analysis reads of a recorded collective, `{"group": {"size", "ranks", "name", "desc"}}`,
so a description naming a mesh dimension tells its parallelism (analyzers.parallel.classify).
"""

from __future__ import annotations

import json
from typing import Any

from gputrace.importers.common import Rows
from gputrace.importers.kineto_json import UNSET, Args, as_int


def _text(v: Any) -> str | None:
    if isinstance(v, bool) or v is UNSET or v is None:
        return None
    if isinstance(v, int):
        return str(v)
    return v if isinstance(v, str) and v and v != "undefined" else None


def _ranks(v: Any) -> list[int] | None:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return None
    if isinstance(v, list) and v and all(type(r) is int and r >= 0 for r in v):
        return v
    return None


def group_args(a: Args | None) -> str | None:
    """The comm args `{"group": {...}}` (JSON) of an event's process-group fields, None
    when it names no group (no name and no description)."""
    if a is None:
        return None
    name, desc = _text(a.pg_name), _text(a.pg_desc)
    if name is None and desc is None:
        return None
    g: dict[str, Any] = {}
    size = as_int(a.group_size)
    ranks = _ranks(a.pg_ranks)
    if size > 0:
        g["size"] = size
    elif ranks:
        g["size"] = len(ranks)
    if ranks:
        g["ranks"] = ranks
    if name is not None:
        g["name"] = name
    if desc is not None:
        g["desc"] = desc
    return json.dumps({"group": g}, separators=(",", ":"))


class Groups:
    """One Kineto file's process groups: the `record_param_comms` ops' by External id, and
    the kernels that wait for them."""

    def __init__(self) -> None:
        self.by_ext: dict[int, str] = {}
        self.pending: list[tuple[int, int]] = []     # (row, External id)

    def op(self, a: Args | None) -> None:
        """A `record_param_comms` op: its group, kept by its External id."""
        g = group_args(a)
        if g is not None and a is not None:
            ext = as_int(a.ext)
            if ext >= 0:
                self.by_ext[ext] = g

    def kernel(self, row: int, a: Args | None) -> str | None:
        """An NCCL kernel's comm args: its own group fields, else (None now) those of the
        op of its External id, set when the file is read (`resolve`)."""
        g = group_args(a)
        if g is None and a is not None:
            ext = as_int(a.ext)
            if ext >= 0:
                self.pending.append((row, ext))
        return g

    def resolve(self, rows: Rows) -> int:
        """Give the waiting kernels their ops' groups; how many got one."""
        import numpy as np

        hit = [(r, self.by_ext[e]) for r, e in self.pending if e in self.by_ext]
        if hit:
            rows.set_many("args", np.array([r for r, _ in hit], np.int64),
                          [g for _, g in hit])
        self.pending.clear()
        return len(hit)
