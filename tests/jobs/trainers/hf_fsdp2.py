"""transformers' own FSDP2 under Hugging Face's `Trainer`: a small Llama (random weights,
saved and loaded back, random tokens) loaded with `from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=2))`, which shards it with `fully_shard` on a
dense mesh (pp, dp_replicate, fsdp, tp) beside an expert mesh (pp, dp_replicate, efsdp,
ep); the Trainer clips the gradients by their norm (max_grad_norm 1.0: a DTensor all-reduce
of the norm) before each step. 2 ranks over gloo:

    torchrun --nproc_per_node 2 hf_fsdp2.py OUT [--steps N]

It times itself with the Trainer's own seams, as hf_trainer.py does (own_clock), and
writes OUT.rank<R>.json with, beside its steps, the meshes transformers made ("meshes":
each one's dimension names and shape) and its world size.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from own_clock import OwnClock
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.distributed import DistributedConfig
from transformers.utils import logging

CLOCK = OwnClock()
SEQ, VOCAB = 32, 256


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
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    saved = f"{a.out}.model.rank{rank}"     # each rank its own copy: no race on the files
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=4, max_position_embeddings=SEQ)
                     ).save_pretrained(saved)
    model = LlamaForCausalLM.from_pretrained(
        saved, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=world))
    args = TrainingArguments(
        output_dir=os.path.dirname(os.path.abspath(a.out)), use_cpu=True, max_steps=a.steps,
        per_device_train_batch_size=4, learning_rate=1e-4, max_grad_norm=1.0,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0)
    trainer = Timed(model=model, args=args, train_dataset=Tokens(4 * a.steps * world + 64),
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
    CLOCK.extra["world"] = world
    CLOCK.write(a.out, rank)


if __name__ == "__main__":
    main()
