"""A 2-rank gloo DDP loop profiled by torch.profiler alone (no gputrace), CPU only: each
rank exports its Kineto JSON to OUTDIR/rank<R>.json. Run under torchrun."""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10)), bucket_cap_mb=1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))


def done(p):
    p.export_chrome_trace(os.path.join(out, f"rank{rank}.json"))


with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=8),
             on_trace_ready=done) as prof:
    for _ in range(10):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        prof.step()
model = opt = loss = prof = None   # the last all-reduces' works, on this thread (ddp_grads.py)
gc.collect()
dist.destroy_process_group()
