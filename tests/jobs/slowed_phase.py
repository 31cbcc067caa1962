"""A small CPU training loop that can be slowed in its backward by a known amount and times
itself with perf_counter: the ground truth of `gputrace diff`.

    python slowed_phase.py OUT.json [--backward-extra-ms X] [--steps N] [--model small|other]

The extra time is a busy wait in a backward hook of the middle layer, so it lies inside the
backward pass. Per step it writes `forward`, `backward`, `update`, `iteration` (seconds) and
`extra` (the wait the hook itself measured).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--backward-extra-ms", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", choices=("small", "other"), default="small")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if a.model == "small":
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10))
        slowed = model[2]
    else:
        model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Tanh(),
                                    torch.nn.Linear(128, 10))
        slowed = model[0]
    now = time.perf_counter
    extra: list[float] = []

    def wait(_module, _gin, _gout):  # type: ignore[no-untyped-def]
        t0 = now()
        until = t0 + a.backward_extra_ms / 1e3
        while now() < until:
            pass
        extra.append(now() - t0)

    if a.backward_extra_ms > 0:
        slowed.register_full_backward_hook(wait)
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    steps = []
    for _ in range(a.steps):
        t0 = now()
        loss = loss_fn(model(x), y)
        t1 = now()
        loss.backward()
        t2 = now()
        opt.step()
        t3 = now()
        opt.zero_grad()
        float(loss.detach())
        t4 = now()
        steps.append({"forward": t1 - t0, "backward": t2 - t1, "update": t3 - t2,
                      "iteration": t4 - t0, "extra": extra[-1] if extra else 0.0})
    with open(a.out, "w") as f:
        json.dump(steps, f)


if __name__ == "__main__":
    main()
