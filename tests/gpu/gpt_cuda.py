"""bench/train_gpt.py's GPT-2-shaped model (12 blocks by default) trained on CUDA (--device), timing
its own steps as bench/train_gpt.py does: the overhead check's transformer on a GPU.

    python gpt_cuda.py OUT.json [--blocks 12] [--width 768] [--heads 12] [--seq 256]
                       [--batch 8] [--iterations 20]

OUT.json: per optimizer step `start`/`end` (time.time_ns; each step ends with the loss on
the host) and the loop's own `forward`, `backward`, `update` seconds (perf_counter).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from train_gpt import GPT, build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--impl", choices=("auto", "hf", "torch"), default="torch")
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda (cpu: to try the job anywhere)")
    a = p.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = build(a.impl, a.vocab, a.seq, a.width, a.blocks, a.heads).to(dev)
    hf = not isinstance(model, GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, a.vocab, (4, a.batch, a.seq + 1), device=dev)
    now = time.perf_counter
    steps = []
    t_prev = time.time_ns()
    for i in range(a.iterations):
        batch = data[i % len(data)]
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        t0 = now()
        out = model(x)
        logits = out.logits if hf else out
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        t1 = now()
        loss.backward()
        t2 = now()
        opt.step()
        t3 = now()
        opt.zero_grad(set_to_none=True)
        loss.item()
        t_end = time.time_ns()
        steps.append({"forward": t1 - t0, "backward": t2 - t1, "update": t3 - t2,
                      "start": t_prev, "end": t_end})
        t_prev = t_end
    with open(a.out, "w") as f:
        json.dump(steps, f)


if __name__ == "__main__":
    main()
