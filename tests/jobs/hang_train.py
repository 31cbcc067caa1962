"""2-rank gloo training loop whose gradients are all-reduced by the job itself (one
`dist.all_reduce` per iteration on the default group), where one rank sleeps before the
all-reduce of one iteration: the other waits in it for as long (a hang that ends).

    torchrun --nproc_per_node 2 hang_train.py OUT.json [--iterations N] [--hang-at K]
                                              [--late-rank R] [--sleep S]

`--hang-at -1`: the late rank sleeps before the barrier, its first collective, before any
iteration (`step` -1, `collective` "barrier", `seq` 1).

Each rank counts the collectives it issues on the default group (the barrier first, then
one all-reduce per iteration) and writes OUT.rankR.json: `iterations`, `collectives` (its
count), and for the iteration K: `step` K, `collective` "all_reduce", `seq` (its number in
the count, from 1), `slept_s` (the late rank's sleep, perf_counter; 0 on the others),
`waited_s` (the time this rank stood in that all-reduce, perf_counter), `entered_wall` and
`left_wall` (time.time() around it); `longest_s`: the longest it stood in any of its
collectives (perf_counter). The late rank writes OUT.sleeping ({"wall": time.time()
as it begins to sleep, "seq", "sleep_s"}) before it sleeps."""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--hang-at", type=int, default=5)
    p.add_argument("--late-rank", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    now = time.perf_counter
    seq = 0
    truth: dict = {"rank": rank, "step": a.hang_at, "collective": "all_reduce", "slept_s": 0.0}
    if a.hang_at < 0:
        truth.update({"collective": "barrier", "seq": 1})
        if rank == a.late_rank and a.sleep > 0:
            with open(a.out.replace(".json", ".sleeping"), "w") as f:
                json.dump({"wall": time.time(), "seq": 1, "sleep_s": a.sleep}, f)
            t = now()
            time.sleep(a.sleep)
            truth["slept_s"] = now() - t
        truth["entered_wall"] = time.time()
    t = now()
    dist.barrier()
    seq += 1
    longest = now() - t
    if a.hang_at < 0:
        truth["waited_s"] = longest
        truth["left_wall"] = time.time()
    for i in range(a.iterations):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
        if i == a.hang_at:
            truth["seq"] = seq + 1
            if rank == a.late_rank and a.sleep > 0:
                with open(a.out.replace(".json", ".sleeping"), "w") as f:
                    json.dump({"wall": time.time(), "seq": seq + 1, "sleep_s": a.sleep}, f)
                t = now()
                time.sleep(a.sleep)
                truth["slept_s"] = now() - t
            truth["entered_wall"] = time.time()
        t = now()
        dist.all_reduce(flat)
        seq += 1
        longest = max(longest, now() - t)
        if i == a.hang_at:
            truth["waited_s"] = now() - t
            truth["left_wall"] = time.time()
        k = 0
        for q in model.parameters():
            q.grad.copy_(flat[k:k + q.numel()].view_as(q) / dist.get_world_size())
            k += q.numel()
        opt.step()
    truth["iterations"] = a.iterations
    truth["collectives"] = seq
    truth["longest_s"] = longest
    with open(a.out.replace(".json", f".rank{rank}.json"), "w") as f:
        json.dump(truth, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
