"""2-rank gloo DDP of a small stack of layers over many short iterations, timing itself:
each rank writes argv[1] with its rank in the name (`OUT.rank0.json`) holding, per
optimizer step, the loop's own perf_counter times (seconds): `t_iter` (iterations tile the
loop: from the previous step's end, the first from its first forward), `forward` (model
and loss), `backward` and `update`.

    torchrun --nproc_per_node 2 window_loop.py OUT.json [--iterations N] [--spike-at K]
                                               [--start-at T]

`--spike-at K`: iteration K sleeps 60 ms more (a stall that a window elsewhere misses).
`--width W`: the layers' width (16). Each row also holds `grad_wait`: from the backward's
last gradient (its first layer's, accumulated) to `backward()` returning, the job's wait
for DDP's gradient sync (its last all-reduce, the copy of the buckets back into the
gradients).
`--until FILE` / `--stop-at T`: the loop runs until FILE exists / until time.time() T (at
most --iterations; the ranks agree on the iteration they stop at); rank 0 writes
`OUT.ready` once the loop has begun. Each row also holds `wall`: time.time() at the
iteration's first forward. `--progress FILE`: each rank appends to FILE with its rank in the
name (`FILE.rank0`), as each iteration ends, a line `step wall t_iter` (flushed: it survives
a kill -9). At the end each rank also writes `OUT.rank0.run.json`: `process_start` (the
kernel's, as tests/jobs/run_phases.py reads it) and `end` (main's last line), time.time_ns
(its whole run, for its goodput)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from run_phases import process_start_ns
from torch import nn

T0_PROCESS = process_start_ns()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--spike-at", type=int, default=-1)
    p.add_argument("--until", default="")
    p.add_argument("--stop-at", type=float, default=0.0)
    p.add_argument("--start-at", type=float, default=0.0,
                   help="begin the loop at this time.time(), not before")
    p.add_argument("--progress", default="")
    p.add_argument("--width", type=int, default=16)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = a.width
    model = nn.Sequential(*[nn.Linear(w, w) for _ in range(24)])
    ddp = nn.parallel.DistributedDataParallel(model)
    ready: list[float] = []      # the first layer's gradients: the backward's last
    for q in model[0].parameters():
        q.register_post_accumulate_grad_hook(lambda _: ready.append(time.perf_counter()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, w, generator=g), torch.randn(8, w, generator=g)
    now = time.perf_counter
    rows = []
    prev = None
    log = open(f"{a.progress}.rank{rank}", "a", buffering=1) if a.progress else None
    time.sleep(max(0.0, a.start_at - time.time()))
    dist.barrier()
    if rank == 0:
        open(a.out.replace(".json", ".ready"), "w").close()
    for i in range(a.iterations):
        if a.until or a.stop_at:     # the ranks agree to stop at the same iteration
            stop = torch.tensor([float((a.until and os.path.exists(a.until))
                                       or (a.stop_at and time.time() >= a.stop_at))])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
        wall = time.time()
        t0 = now()
        prev = t0 if prev is None else prev
        loss = nn.functional.mse_loss(ddp(x), y)
        t1 = now()
        ready.clear()
        loss.backward()
        t2 = now()
        grad_wait = t2 - max(ready) if ready else 0.0
        opt.step()
        t3 = now()
        rows.append({"t_iter": t3 - prev, "forward": t1 - t0, "backward": t2 - t1,
                     "update": t3 - t2, "wall": wall, "grad_wait": grad_wait})
        prev = t3
        if log is not None:
            log.write(f"{i} {wall!r} {rows[-1]['t_iter']!r}\n")
        # the loop's bookkeeping, inside the next iteration (iterations tile the loop)
        opt.zero_grad()
        time.sleep(0.06 if i == a.spike_at else 0.001)
    with open(a.out.replace(".json", f".rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    ddp = opt = loss = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    with open(a.out.replace(".json", f".rank{rank}.run.json"), "w") as f:
        json.dump({"process_start": T0_PROCESS, "end": time.time_ns()}, f)


if __name__ == "__main__":
    main()
