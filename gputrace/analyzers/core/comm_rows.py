"""The record of a rank's comm spans (Rows, one entry per span, filled by
analyzers.core.collectives.rows) and the kinds of collective: a kind from a span's or a kernel's
name."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv",
         "barrier", "reduce", "gather", "scatter")

# NCCL kernel names (ncclKernel_AllGather_RING_LL_Sum_int8_t, ncclDevKernel_ReduceScatter_...,
# ncclKernel_SendRecv, nccl:all_gather) and gloo's own ranges (gloo:all_reduce) -> kind
_KERNEL = [(re.compile(p, re.I), k) for p, k in (
    (r"all_?gather|allgather", "all_gather"),
    (r"reduce_?scatter|reducescatter", "reduce_scatter"),
    (r"all_?reduce|allreduce", "all_reduce"),
    (r"all_?to_?all|alltoall", "all_to_all"),
    (r"send_?recv|sendrecv|\bsend\b|\brecv\b|_send|_recv", "send_recv"),
    (r"broadcast|bcast", "broadcast"),
    (r"barrier", "barrier"),
    (r"reduce", "reduce"),
    (r"gather", "gather"),
    (r"scatter", "scatter"),
)]


def kind_of(name: str) -> str | None:
    """A collective's kind from a span or kernel name (`allreduce`, an NCCL kernel's)."""
    if name in KINDS:
        return name
    for pat, k in _KERNEL:
        if pat.search(name):
            return k
    return None


@dataclass(frozen=True)
class Rows:
    """The parsed comm spans of one rank, one entry each (in span order)."""

    idx: np.ndarray            # rows into the rank's Spans
    kind: list[str]
    contract: np.ndarray       # bool: carries args.kind (recorded by the collector)
    nbytes: np.ndarray         # float, nan unknown
    bytes_out: np.ndarray
    is_async: np.ndarray
    phase: list[str]
    wait_s: np.ndarray         # ns, -1 none
    wait_e: np.ndarray
    fsdp: list[str]            # "" when not FSDP's
    unit: list[str | None]
    role: list[str]
    prefetch: np.ndarray
    group_size: np.ndarray     # -1 unknown
    gradient: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # gradient_mask
    # the parallelism each serves (parallel.classify: dp fsdp tp pp ep cp other)
    dim: list[str] = field(default_factory=list)
    mesh_dim: list[str] = field(default_factory=list)   # its DeviceMesh dimension, "" none
    group_ranks: list[tuple[int, ...] | None] = field(default_factory=list)  # its group's
    # an asynchronous functional collective's issuing call [start, end] ns, -1 none
    call_s: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    call_e: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # gradient rows of a few bytes (under `small_below`): comm, but never a gradient unit
    small: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    small_below: float = 0.0
    # per row, why it serves no parallelism (`other`: parallel.classify.role), "" told
    why: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return int(self.idx.size)
