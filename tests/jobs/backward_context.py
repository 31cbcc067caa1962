"""Whether the collectives a job issues inside its backward over gloo keep the backward's
Python context alive on gloo's side.

torch (2.13) stashes a `contextvars` context in the thread's state for each backward; a
gloo collective copies that state into its Work, and gloo's thread, freeing the Work, takes
the GIL to drop the context: a process that ends right after its last backward can abort
there. This job issues an all-reduce from a gradient hook (its own call) and from DDP's comm
hook (a bucket), keeps their Works, and after the backward counts the references
to that backward's context beyond its own: 0 where no Work holds it. Prints one JSON line.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
ddp = nn.parallel.DistributedDataParallel(nn.Linear(32, 32))
works = []
seen = []


def hook(p):
    """The job's own all-reduce of a gradient, inside the backward; the context it runs in."""
    seen.append(torch._C._get_obj_in_tls("context"))
    works.append(dist.all_reduce(p.grad, async_op=True))


def comm_hook(state, bucket):
    """DDP's bucket all-reduced as torch's default hook does, its Work kept."""
    seen.append(torch._C._get_obj_in_tls("context"))
    w = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)
    works.append(w)
    return w.get_future().then(lambda f: f.value()[0])


model[0].weight.register_post_accumulate_grad_hook(hook)
ddp.register_comm_hook(None, comm_hook)
out = {}
for name, net in (("own", model), ("ddp", ddp)):
    seen.clear()
    works.clear()
    for _ in range(3):
        net(torch.randn(8, 32)).sum().backward()
    for w in works:
        w.wait()
    ctx = seen[-1]
    # its references: `ctx`, `seen`'s, getrefcount's argument; more are Works' on gloo's side
    out[name] = sys.getrefcount(ctx) - 3
out["pid"] = os.getpid()
print(json.dumps(out), flush=True)
dist.destroy_process_group()
