"""A training loop with Hugging Face accelerate, as its docs write it: `Accelerator()`,
`accelerator.prepare(model, optimizer, loader)`, `accelerator.backward(loss)`. With
`--checkpoint` each block recomputes its activations in the backward
(`torch.utils.checkpoint`, non-reentrant), as large models are trained:

    python accelerate_loop.py OUT [--checkpoint] [--steps N]

It times its forward (model and loss), `accelerator.backward` and the optimizer's step with
perf_counter and writes OUT.rank<R>.json (own_clock)."""

from __future__ import annotations

import argparse
import time

import torch
from accelerate import Accelerator
from own_clock import OwnClock, blocks_model, dataset
from torch.utils.checkpoint import checkpoint


class Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    model = blocks_model()
    if a.checkpoint:
        for i, b in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(b)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(dataset(64 * a.steps), batch_size=64, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    loss_fn = torch.nn.CrossEntropyLoss()
    clock = OwnClock()
    now = time.perf_counter
    model.train()
    for x, y in loader:
        clock.fed(len(x))
        t0 = now()
        loss = loss_fn(model(x), y)
        t1 = now()
        accelerator.backward(loss)
        t2 = now()
        opt.step()
        t3 = now()
        opt.zero_grad()
        clock.add("forward", t1 - t0)
        clock.add("backward", t2 - t1)
        clock.add("update", t3 - t2)
        clock.step_done()
    clock.write(a.out, accelerator.process_index)


if __name__ == "__main__":
    main()
