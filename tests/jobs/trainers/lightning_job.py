"""A PyTorch Lightning job as Lightning's docs write it: `training_step` calls `self.net(x)`
and returns the loss, `Trainer.fit` runs the loop. It times itself with Lightning's own hooks:

    python lightning_job.py OUT --mode auto|manual|ddp [--steps N]

auto: automatic optimization (Lightning calls optimizer.step with a closure that runs
training_step and the backward); manual: `self.manual_backward` and the optimizer's step in
training_step; ddp: automatic, `Trainer(devices=2, strategy="ddp")` started as `python
lightning_job.py`: Lightning starts the second process itself, no launcher variables.

forward: from training_step's start to `on_before_backward` (the net and the loss);
backward: `on_before_backward` to `on_after_backward`; update: from there to the optimizer
step's return; an iteration ends at `on_train_batch_end`. Writes OUT.rank<R>.json
(own_clock), with the DDP buckets under ddp.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from own_clock import OwnClock, blocks_model, dataset, ddp_buckets
from torch.utils.data import DataLoader

CLOCK = OwnClock()


class Job(L.LightningModule):
    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.net = blocks_model()
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.automatic_optimization:
            CLOCK.start("forward")
            return torch.nn.functional.cross_entropy(self.net(x), y)
        opt = self.optimizers()
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        t1 = time.perf_counter()
        self.manual_backward(loss)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        CLOCK.add("forward", t1 - t0)
        CLOCK.add("backward", t2 - t1)
        CLOCK.add("update", t3 - t2)
        return loss

    def on_before_backward(self, loss):
        if not self.automatic_optimization:
            return   # training_step times it
        CLOCK.stop("forward")
        CLOCK.start("backward")

    def on_after_backward(self):
        if not self.automatic_optimization:
            return
        CLOCK.stop("backward")
        CLOCK.start("update")

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        CLOCK.stop("update")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        CLOCK.fed(len(batch[0]))
        CLOCK.step_done()

    def on_train_end(self):
        model = self.trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            CLOCK.extra["buckets"] = ddp_buckets(model)
        CLOCK.extra["world_size"] = self.trainer.world_size

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", choices=("auto", "manual", "ddp"), default="auto")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ddp = a.mode == "ddp"
    # small buckets: several gradient units
    strategy = L.pytorch.strategies.DDPStrategy(bucket_cap_mb=0.5) if ddp else "auto"
    trainer = L.Trainer(max_steps=a.steps, accelerator="cpu", devices=2 if ddp else 1,
                        strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    job = Job(manual=a.mode == "manual")
    trainer.fit(job, DataLoader(dataset(64 * a.steps), batch_size=64))
    CLOCK.write(a.out, trainer.global_rank)


if __name__ == "__main__":
    main()
