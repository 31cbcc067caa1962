"""A CUDA training loop that times each of its phases with CUDA events: the ground truth for
gputrace on a GPU (gpu-marked tests; run it by hand under `gputrace record` to compare).

    python cuda_loop.py TRUTH.json [--pinned] [--steps N] [--sync-every K]

Per step: the batch copied to the GPU (`x.to`, pageable or pinned), forward and loss,
backward, optimizer step, zero_grad; a CUDA event is recorded as the host enters and leaves
each phase, and the loop's own iteration boundaries are taken on the host (time.time_ns at
each optimizer step's end: where gputrace's iterations begin and end without a loader).
TRUTH.json: per step, `h2d forward backward update` in seconds (event to event) and
`start end` (ns). With --sync-every K > 1 the host runs ahead of the GPU between syncs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("truth")
    p.add_argument("--pinned", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--width", type=int, default=4096)
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    w = a.width
    model = torch.nn.Sequential(
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 1000)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x_cpu = torch.randn(a.batch, w)
    y_cpu = torch.randint(0, 1000, (a.batch,))
    if a.pinned:
        x_cpu, y_cpu = x_cpu.pin_memory(), y_cpu.pin_memory()
    names = ("h2d", "forward", "backward", "update")
    pending: list[tuple[list[torch.cuda.Event], dict[str, float]]] = []
    steps: list[dict[str, float]] = []
    t_prev = time.time_ns()
    for k in range(a.steps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
        ev[0].record()
        x = x_cpu.to(dev, non_blocking=a.pinned)
        y = y_cpu.to(dev, non_blocking=a.pinned)
        ev[1].record()
        ev[2].record()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        ev[3].record()
        ev[4].record()
        loss.backward()
        ev[5].record()
        ev[6].record()
        opt.step()
        ev[7].record()
        t_end = time.time_ns()
        opt.zero_grad(set_to_none=True)
        pending.append((ev, {"start": t_prev, "end": t_end}))
        t_prev = t_end
        if (k + 1) % a.sync_every == 0 or k + 1 == a.steps:
            torch.cuda.synchronize()
            for evs, row in pending:
                for i, n in enumerate(names):
                    row[n] = evs[2 * i].elapsed_time(evs[2 * i + 1]) / 1e3
                steps.append(row)
            pending = []
    with open(a.truth, "w") as f:
        json.dump(steps, f)
    print(f"cuda_loop: {a.steps} steps, median iteration "
          f"{sorted(s['end'] - s['start'] for s in steps)[len(steps) // 2] / 1e6:.2f} ms")


if __name__ == "__main__":
    main()
