"""A process's rank and world size from torch.distributed, for jobs whose launcher sets no
variables: `torch.multiprocessing.spawn` (PyTorch's DDP tutorial), Lightning's and
accelerate's own launchers, a harness that calls `init_process_group(rank=..., world_size=...)`.

The recorder asks at each flush until the default process group exists (`Recorder.learn_rank`);
the first collective recorded and `destroy_process_group` ask at once, so a short job still
learns it before the group is gone. Under torchrun, mpirun or srun the answer is the rank the
environment gave."""

from __future__ import annotations

import functools
import sys
from typing import Any

from gputrace.recorder.core import Recorder


def dist_rank() -> tuple[int, int] | None:
    """(rank, world size) of the default process group, None while there is none."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def learn_rank_from_torch(rec: Recorder) -> None:
    """Have `rec` learn its rank from torch.distributed (asked until it answers)."""
    rec.rank_source = dist_rank
    rec.learn_rank()
    _patch_destroy()


def _patch_destroy() -> None:
    try:
        from torch.distributed import distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - a torch built without distributed
        return
    orig = c10d.destroy_process_group
    if getattr(orig, "_gputrace_orig", None) is not None:
        return

    @functools.wraps(orig)
    def destroy_process_group(*a: Any, **k: Any) -> Any:
        from gputrace.recorder.core import current

        rec = current()
        if rec is not None and rec.rank_source is not None:
            rec.learn_rank()
        return orig(*a, **k)

    destroy_process_group._gputrace_orig = orig  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    import torch.distributed as dist

    if getattr(dist, "destroy_process_group", None) is orig:
        dist.destroy_process_group = destroy_process_group
