"""A launch-bound CUDA training loop: a tiny model whose forward is a chain of LAUNCHES
elementwise ops on a small tensor (one kernel each; backward as many again), so the host's
launch rate, not the GPU, sets the pace; the overhead check's worst case for CUPTI.

    python launch_loop.py OUT.json [--steps 40] [--launches 1000]

OUT.json: per optimizer step `start`/`end` (time.time_ns, each step ends with the loss on
the host: the GPU is done with it) and `ops`, the elementwise ops it issued (a lower bound
of the kernels launched); with the job's own elapsed seconds, `launches_per_s` (ops / s).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--launches", type=int, default=1000)
    p.add_argument("--device", default="cuda", help="cuda (cpu: to try the job anywhere)")
    a = p.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16, device=dev)
    steps = []
    t_prev = time.time_ns()
    for _ in range(a.steps):
        h = model(x)
        for _ in range(a.launches):
            h = h * 1.0001
        loss = h.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        t_end = time.time_ns()
        # the chain forward and its backward: 2 ops per link
        steps.append({"start": t_prev, "end": t_end, "ops": 2 * a.launches})
        t_prev = t_end
    with open(a.out, "w") as f:
        json.dump(steps, f)
    s = sorted((r["end"] - r["start"]) / 1e9 for r in steps)[len(steps) // 2]
    print(f"launch_loop: {a.steps} steps, median {s * 1e3:.2f} ms, "
          f"{2 * a.launches / s:.0f} ops/s")


if __name__ == "__main__":
    main()
