"""A Lightning fit with validation and checkpoints, timing itself with Lightning's hooks:

    python lightning_whole.py OUT.json [--steps 30] [--val-every 10]

`Trainer.fit` with a sanity check (2 validation batches before training), a 4-batch
validation every `--val-every` steps and `ModelCheckpoint(every_n_train_steps=...)`. Writes
the steps it trained (`steps`: Lightning's global_step after each), each validation pass
(`evals[]`: `on_validation_start` to `on_validation_end`, `sanity` for the first) and each
checkpoint save (`saves[]`: `Trainer.save_checkpoint`'s call, its file's bytes), in
time.time_ns.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

TRUTH: dict = {"steps": [], "evals": [], "saves": []}


class Job(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        TRUTH["steps"].append(self.trainer.global_step - 1)

    def on_validation_start(self):
        TRUTH["evals"].append({"start": time.time_ns(), "sanity": self.trainer.sanity_checking})

    def on_validation_end(self):
        TRUTH["evals"][-1]["end"] = time.time_ns()


class Timed(L.Trainer):
    def save_checkpoint(self, filepath, *args, **kwargs):
        t0 = time.time_ns()
        out = super().save_checkpoint(filepath, *args, **kwargs)
        TRUTH["saves"].append({"start": t0, "end": time.time_ns(),
                               "bytes": os.path.getsize(filepath)})
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--val-every", type=int, default=10)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32 * (a.steps + 2), 64, generator=g),
                         torch.randint(0, 10, (32 * (a.steps + 2),), generator=g))
    val = TensorDataset(torch.randn(32 * 4, 64, generator=g),
                        torch.randint(0, 10, (32 * 4,), generator=g))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=os.path.splitext(a.out)[0] + ".ckpt", every_n_train_steps=a.val_every,
        save_top_k=-1)
    trainer = Timed(max_steps=a.steps, val_check_interval=a.val_every, limit_val_batches=4,
                    num_sanity_val_steps=2, callbacks=[ckpt], logger=False,
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                    devices=1)
    trainer.fit(Job(), DataLoader(data, batch_size=32), DataLoader(val, batch_size=32))
    with open(a.out, "w") as f:
        json.dump(TRUTH, f)


if __name__ == "__main__":
    main()
