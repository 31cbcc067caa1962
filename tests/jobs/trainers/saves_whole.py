"""Frameworks' saves outside a trainer, timing themselves: a training loop that saves its
checkpoints with the framework's own call every N steps.

    torchrun --nproc_per_node 2 saves_whole.py OUT.json --kind deepspeed [--steps 20] [--every 10]
    python saves_whole.py OUT.json --kind hf [--steps 20] [--every 10]

deepspeed: an MLP under DeepSpeed ZeRO stage 1 on 2 ranks over gloo on the CPU, each save
`engine.save_checkpoint(DIR, tag)`; hf: a small GPT-2 built from its config (no download)
trained by a plain loop, each save `model.save_pretrained(DIR)` into the same folder. Its
own clock (perf_counter on time.time_ns's clock) around each save (`saves[]`: `start`,
`end`, and `bytes`: the files under the save's folder after it, all ranks' for DeepSpeed's,
read after a barrier); OUT.rank<R>.json for DeepSpeed's ranks."""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

_PC0, _WALL0 = time.perf_counter_ns(), time.time_ns()


def now() -> int:
    return _WALL0 + time.perf_counter_ns() - _PC0


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def deepspeed_run(a: argparse.Namespace, truth: dict) -> str:
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=torch.optim.Adam(model.parameters()))
    loss_fn = torch.nn.CrossEntropyLoss()
    where = os.path.splitext(a.out)[0] + ".ds"
    for step in range(a.steps):
        x, y = torch.randn(16, 256), torch.randint(0, 10, (16,))
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        if (step + 1) % a.every == 0:
            tag = f"step{step + 1}"
            t0 = now()
            engine.save_checkpoint(where, tag=tag)
            t1 = now()
            dist.barrier()
            truth["saves"].append({"start": t0, "end": t1,
                                   "bytes": folder_bytes(os.path.join(where, tag))})
    dist.barrier()
    return f"{os.path.splitext(a.out)[0]}.rank{rank}.json"


def hf_run(a: argparse.Namespace, truth: dict) -> str:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000,
                                       n_positions=64, bos_token_id=0,
                                       eos_token_id=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    where = os.path.splitext(a.out)[0] + ".hf"
    for step in range(a.steps):
        x = torch.randint(0, 1000, (8, 32))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % a.every == 0:
            t0 = now()
            model.save_pretrained(where)
            truth["saves"].append({"start": t0, "end": now(), "bytes": folder_bytes(where)})
    return a.out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--kind", choices=("deepspeed", "hf"), required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    truth: dict = {"saves": []}
    out = deepspeed_run(a, truth) if a.kind == "deepspeed" else hf_run(a, truth)
    with open(out, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main()
