"""A training loop that knows its own throughput: each iteration (ACC micro-batches of B
samples, then the optimizer step) timed with perf_counter, the samples it fed counted.

    python throughput_train.py OUT [--tokens] [--iterations N] [--batch B] [--acc K]
    torchrun --nproc_per_node 2 throughput_train.py OUT ...   (DDP over gloo)

--tokens: a token model (embedding, linear head) called as `model(input_ids=ids)` with a
2-D integer batch of B x SEQ token ids, as Hugging Face models are called; otherwise an MLP
called as `model(x)`. Writes OUT.rank<R>.json: {"iterations": [seconds...], "samples":
samples per iteration, "tokens_per_sample": SEQ or null, "rss_peak_bytes": its own peak
resident set size (getrusage) at the end}. --hold-mb M --hold-rank R: rank R holds M MiB more
(written to, so resident) throughout. --spike-mb M --spike-rank R --spike-step S: in the
forward pass of iteration S rank R allocates M MiB (written to, so resident) and holds them
until its optimizer step has run; every rank reads its own resident set size
(/proc/self/statm) there, after that allocation, written as "spike_rss_bytes".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SEQ, VOCAB, WIDTH = 32, 512, 256


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(input_ids)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", action="store_true")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--acc", type=int, default=2)
    ap.add_argument("--hold-mb", type=int, default=0)
    ap.add_argument("--hold-rank", type=int, default=0)
    ap.add_argument("--spike-mb", type=int, default=0)
    ap.add_argument("--spike-rank", type=int, default=0)
    ap.add_argument("--spike-step", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = 0
    model: nn.Module = TokenModel() if a.tokens else nn.Sequential(
        nn.Linear(WIDTH, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    held = torch.ones(a.hold_mb << 18) if a.hold_mb and rank == a.hold_rank else None
    spike: dict[str, Any] = {"on": False, "tensor": None, "rss": None}

    def in_forward(module: nn.Module, args: Any) -> None:
        if spike["on"] and spike["rss"] is None:
            if a.spike_mb and rank == a.spike_rank:
                spike["tensor"] = torch.ones(a.spike_mb << 18)   # float32: 4 bytes each
            with open("/proc/self/statm") as f:
                spike["rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    first = model.module[0] if isinstance(model, nn.parallel.DistributedDataParallel) \
        else model[0] if isinstance(model, nn.Sequential) else model.embed
    first.register_forward_pre_hook(in_forward)
    its = []
    for i in range(a.iterations):
        spike["on"] = i == a.spike_step
        t0 = time.perf_counter()
        for _ in range(a.acc):
            if a.tokens:
                ids = torch.randint(0, VOCAB, (a.batch, SEQ))
                out = model(input_ids=ids)
                loss = nn.functional.cross_entropy(out.reshape(-1, VOCAB), ids.reshape(-1))
            else:
                x, y = torch.randn(a.batch, WIDTH), torch.randint(0, 10, (a.batch,))
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        spike["tensor"] = None
        opt.zero_grad()
        its.append(time.perf_counter() - t0)
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump({"iterations": its, "samples": a.batch * a.acc,
                   "tokens_per_sample": SEQ if a.tokens else None,
                   "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "held": held is not None, "spike_rss_bytes": spike["rss"]}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
