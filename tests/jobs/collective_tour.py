"""Every other torch.distributed call, issued by the job itself (2 ranks over gloo on the
CPU), counted at the ProcessGroup (collective_truth) for comparison with the recording.

    torchrun --nproc_per_node 2 collective_tour.py OUT_PREFIX [--iterations N]

Per iteration: all_gather_into_tensor (which calls all_gather_single inside torch),
all_gather_single, reduce_scatter_tensor, reduce_scatter (lists), reduce, gather, scatter,
barrier, isend/irecv (waited), an async all_reduce never waited on (torch completes it),
and batch_isend_irecv (the job's phase `batch`: one record for the batch, two process-group
calls). After the iterations, when run under gputrace, the recorder's bookkeeping of a
collective is made to fail (`--break`): the collectives must still run and give the right
result; the job prints `RESULT ok` when they did.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402


def functional(x: torch.Tensor, rank: int) -> list[dict[str, object]]:
    """c10d's functional collectives and a DTensor gathered whole: what each issued (kind,
    bytes in and out) and when the job first used its result (time.time_ns around it)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    done = []

    def use(kind: str, nin: int, nout: int, res: torch.Tensor) -> None:
        t0 = time.time_ns()
        float(res.sum())             # the first use waits for the collective
        done.append({"kind": kind, "bytes": nin, "bytes_out": nout, "start": t0,
                     "end": time.time_ns()})

    y = x[:256].clone()
    use("all_reduce", 1024, 1024, funcol.all_reduce(y, "sum", dist.group.WORLD))
    use("all_gather", 1024, 2048, funcol.all_gather_single(y, 0, dist.group.WORLD))
    mesh = init_device_mesh("cpu", (2,))
    big = torch.arange(512, dtype=torch.float32)
    d = distribute_tensor(big, mesh, [Shard(0)])      # scatters from rank 0: not counted
    t0 = time.time_ns()
    whole = d.full_tensor()          # all-gathers the shards (1 KiB each)
    done.append({"kind": "all_gather", "bytes": 1024, "bytes_out": 2048, "start": t0,
                 "end": time.time_ns(), "dtensor": True})
    assert torch.equal(whole, big)
    return done


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--break", dest="brk", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = 1 - rank
    truth = Truth()
    n = 1024
    x = torch.full((n,), float(rank + 1))
    unwaited = []
    for i in range(a.iterations):
        truth.begin(i)
        dist.all_gather_into_tensor(torch.empty(world * n), x)
        dist.all_gather_single(torch.empty(world * n // 2), x[: n // 2])
        dist.reduce_scatter_tensor(torch.empty(n // world), x.clone())
        dist.reduce_scatter(torch.empty(n // 4), [x[: n // 4].clone() for _ in range(world)])
        dist.reduce(x.clone(), dst=0)
        dist.gather(x[:8].clone(), [torch.empty(8) for _ in range(world)] if rank == 0
                    else None, dst=0)
        dist.scatter(torch.empty(16), [torch.ones(16) for _ in range(world)] if rank == 0
                     else None, src=0)
        dist.barrier()
        send = dist.isend(x[:32].clone(), peer)
        buf = torch.empty(32)
        recv = dist.irecv(buf, peer)
        send.wait()
        recv.wait()
        unwaited.append(dist.all_reduce(x[:64].clone(), async_op=True))
        truth.phase = "batch"
        ops = [dist.P2POp(dist.isend, x[:128].clone(), peer),
               dist.P2POp(dist.irecv, torch.empty(128), peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        truth.phase = "none"
        truth.end()
    time.sleep(0.2)                 # the unwaited all-reduces complete on their own
    truth.functional = functional(x, rank)
    truth.dump(f"{a.out}.rank{rank}.json")
    if a.brk:
        from gputrace.collectors.torch import comm as torch_comm

        def broken(group: object) -> str:
            raise RuntimeError("bookkeeping bug")

        torch_comm._group_json = broken
        ok = True
        for _ in range(2):
            t = torch.ones(4) * (rank + 1)
            dist.all_reduce(t)
            ok = ok and bool((t == 3).all())
            w = dist.all_reduce(t, async_op=True)
            w.wait()
            ok = ok and bool((t == 6).all())
        print("RESULT ok" if ok else "RESULT wrong", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
