"""A loop as Lightning and Hugging Face's trainers run one: evaluation batches (a
DataLoader, no grad) before training, then training batches from a DataLoader with an
optimizer step each:

    python flops_eval.py OUT [--eval N] [--train N] [--bad-formula]

The model is three Linear layers of known size; the job counts its own FLOPs (2*m*n*k per
product; the backward twice the forward, less the first layer's input gradient, which no
one needs) and writes OUT: {"train_flops" (forward + backward of one training batch),
"eval_flops" (the forward of one evaluation batch), "trained", "evaluated"}.

--bad-formula runs, between the layers, an operation of the job's own whose FLOP formula
(registered with torch.utils.flop_counter, as libraries register theirs) rejects its input,
as torch's formulas do for shapes they do not handle: the job must run as without it."""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH, BATCH = 256, 64


@torch.library.custom_op("flops_eval::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


@scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scale_backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return grad


scale.register_autograd(_scale_backward)


def bad_formula(*args, **kwargs) -> int:  # noqa: ANN002, ANN003
    raise AssertionError("this formula does not handle the shape it was given")


class Model(nn.Module):
    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        if self.bad:
            x = scale(x)
        return self.c(torch.relu(self.b(x)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--eval", type=int, default=4)
    ap.add_argument("--train", type=int, default=7)
    ap.add_argument("--bad-formula", action="store_true")
    a = ap.parse_args()
    if a.bad_formula:
        from torch.utils.flop_counter import register_flop_formula

        register_flop_formula(torch.ops.flops_eval.scale)(bad_formula)
    torch.manual_seed(0)
    model = Model(a.bad_formula)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(BATCH * max(a.eval, a.train), WIDTH))
    evaluated = trained = 0
    with torch.no_grad():
        for (x,) in DataLoader(data, batch_size=BATCH):
            if evaluated == a.eval:
                break
            model(x).sum().item()
            evaluated += 1
    for (x,) in DataLoader(data, batch_size=BATCH):
        if trained == a.train:
            break
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        trained += 1
    fwd = 3 * 2 * BATCH * WIDTH * WIDTH
    with open(a.out, "w") as f:
        json.dump({"train_flops": fwd + 2 * fwd - 2 * BATCH * WIDTH * WIDTH,
                   "eval_flops": fwd, "trained": trained, "evaluated": evaluated}, f)


if __name__ == "__main__":
    main()
