"""A small CPU training loop that can be slowed in its backward by a known amount and times
itself with perf_counter: the ground truth of `gputrace diff`.

    python slowed_phase.py OUT.json [--backward-extra-ms X] [--steps N] [--model small|other]

The extra time is a busy wait in the backward of the middle layer: its output passes through
an identity autograd function whose backward waits, so the wait lies inside that layer's own
backward (between the gradient of its output and that of its input). The forward pass has a cost that varies from step to step as a data-dependent
one does (a sleep of 0-12 ms drawn with a fixed seed: the same in every run). The model is small
so that the run's length depends little on what else the machine is doing. Per step it writes
`forward`, `backward`, `update`, `iteration` (seconds) and `extra` (the wait the hook itself
measured); an OUT ending in .jsonl gets the run's steps appended as one line (a job recorded
several times, `gputrace record --repeat`, keeps every run's).
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
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", choices=("small", "other"), default="small")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if a.model == "small":
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 10))
        slowed = model[2]
    else:
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(),
                                    torch.nn.Unflatten(1, (1, 32)),
                                    torch.nn.Conv1d(1, 1, 3, padding=1), torch.nn.Flatten(),
                                    torch.nn.Linear(32, 10))
        slowed = model[0]
    now = time.perf_counter
    extra: list[float] = []

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            t0 = now()
            until = t0 + a.backward_extra_ms / 1e3
            while now() < until:
                pass
            extra.append(now() - t0)
            return grad

    if a.backward_extra_ms > 0:
        slowed.register_forward_hook(lambda _m, _i, out: Wait.apply(out))
    varies = torch.rand(a.steps, generator=torch.Generator().manual_seed(1)).tolist()

    def data_dependent(_module, _inputs):  # type: ignore[no-untyped-def]
        time.sleep(0.012 * varies[len(steps)])

    model[0].register_forward_pre_hook(data_dependent)
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    steps: list[dict[str, float]] = []
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
    with open(a.out, "a" if a.out.endswith(".jsonl") else "w") as f:
        json.dump(steps, f)
        if a.out.endswith(".jsonl"):
            f.write("\n")


if __name__ == "__main__":
    main()
