"""Hugging Face's `Trainer` on a small GPT-2 (transformers' own model, random tokens), as its
docs write it: `TrainingArguments`, `Trainer(model, args, train_dataset).train()`. One
process, or under torchrun (DDP over gloo, `ddp_bucket_cap_mb` small: several buckets):

    python hf_trainer.py OUT [--accumulate K] [--steps N]
    torchrun --nproc_per_node 2 hf_trainer.py OUT

It times itself with the Trainer's own seams: forward is `compute_loss` (overridden, as users
do), backward is the accelerator's `backward` (timed around the instance's method), update
runs from the `on_pre_optimizer_step` callback to `on_optimizer_step`, an iteration ends at
`on_step_end`. Writes OUT.rank<R>.json (own_clock), with DDP's buckets under torchrun.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from own_clock import OwnClock, ddp_buckets
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging

CLOCK = OwnClock()
SEQ, VOCAB = 32, 1000


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Timed(Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        CLOCK.fed(len(inputs["input_ids"]))
        t0 = time.perf_counter()
        try:
            return super().compute_loss(model, inputs, *args, **kwargs)
        finally:
            CLOCK.add("forward", time.perf_counter() - t0)


class Steps(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        CLOCK.start("update")

    def on_optimizer_step(self, args, state, control, **kwargs):
        CLOCK.stop("update")

    def on_step_end(self, args, state, control, **kwargs):
        CLOCK.step_done()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128,
                                       n_layer=4, n_head=4))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=os.path.dirname(os.path.abspath(a.out)), use_cpu=True, max_steps=a.steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=a.accumulate,
        learning_rate=1e-4, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
        **({"ddp_backend": "gloo", "ddp_bucket_cap_mb": 1, "ddp_find_unused_parameters": False}
           if world > 1 else {}))
    trainer = Timed(model=model, args=args,
                    train_dataset=Tokens(4 * a.accumulate * a.steps * world + 64),
                    callbacks=[Steps()])
    backward = trainer.accelerator.backward

    def timed_backward(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return backward(*args, **kwargs)
        finally:
            CLOCK.add("backward", time.perf_counter() - t0)

    trainer.accelerator.backward = timed_backward
    trainer.train()
    if isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel):
        CLOCK.extra["buckets"] = ddp_buckets(trainer.model_wrapped)
    CLOCK.write(a.out, int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    main()
