"""Hugging Face's Trainer with evaluation and checkpoints every N steps, timing itself:

    python hf_whole.py OUT.json [--steps 30] [--every 10]

TrainingArguments(eval_strategy="steps", save_strategy="steps") on a small GPT-2 (random
tokens). Writes the steps it trained (`steps`: global_step at each `on_step_end`, less one),
each evaluation (`evals[]`: `Trainer.evaluate`'s call) and each checkpoint (`saves[]`:
`Trainer._save_checkpoint`'s call and the bytes its folder holds), in time.time_ns.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging

SEQ, VOCAB = 32, 1000
TRUTH: dict = {"steps": [], "evals": [], "saves": []}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Steps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        TRUTH["steps"].append(state.global_step - 1)


class Timed(Trainer):
    def evaluate(self, *args, **kwargs):
        t0 = time.time_ns()
        out = super().evaluate(*args, **kwargs)
        TRUTH["evals"].append({"start": t0, "end": time.time_ns()})
        return out

    def _save_checkpoint(self, model, trial):
        t0 = time.time_ns()
        out = super()._save_checkpoint(model, trial)
        path = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path)
                   for f in fs)
        TRUTH["saves"].append({"start": t0, "end": time.time_ns(), "bytes": size})
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args()
    logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64,
                                       n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=os.path.splitext(a.out)[0] + ".out", max_steps=a.steps,
        per_device_train_batch_size=8, per_device_eval_batch_size=8,
        eval_strategy="steps", eval_steps=a.every, save_strategy="steps",
        save_steps=a.every, report_to=[], logging_strategy="no", use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = Timed(model=model, args=args, train_dataset=Tokens(8 * (a.steps + 2), 0),
                    eval_dataset=Tokens(8 * 4, 1), callbacks=[Steps()])
    trainer.train()
    with open(a.out, "w") as f:
        json.dump(TRUTH, f)


if __name__ == "__main__":
    main()
