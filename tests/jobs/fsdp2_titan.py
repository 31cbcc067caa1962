"""FSDP2 as torchtitan trains a Llama: transformer blocks (RMSNorm, causal self-attention,
SwiGLU feed-forward) each wrapped for activation checkpointing, `fully_shard` on each block
and the root with bf16 mixed precision (MixedPrecisionPolicy: bf16 parameters, fp32
gradient reduction), AdamW, and the gradients clipped by their norm before each step
(`clip_grad_norm_`: DTensor all-reduces the norm on FSDP's mesh). 2 ranks over gloo:

    torchrun --nproc_per_node 2 fsdp2_titan.py OUT [--mesh default|dp_shard]
        [--iterations N] [--blocks B] [--batch S] [--seq T] [--compile]

`--mesh default`: FSDP2's own mesh (no names); `dp_shard`: init_device_mesh("cpu", (2,),
mesh_dim_names=("dp_shard",)) passed to fully_shard. `--compile`: each checkpointed block
`torch.compile`d (fullgraph) before it is sharded, as torchtitan does.

The job counts its own collectives (c10d's at the ProcessGroup: collective_truth; the
functional ones DTensor issues, from PyTorch's profiler: comm_clock) and times its phases
(forward, backward, clip, update) and iterations, and writes OUT.rank<R>.json:
{"iterations", "calls", "functional", "stood", "samples" (per iteration, this rank's),
"tokens_per_sample", "mesh" (the mesh dimension's name, "" none)}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402
from comm_clock import CommClock  # noqa: E402

VOCAB = 256


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, 4 * d, bias=False)
        self.w2 = nn.Linear(4 * d, d, bias=False)
        self.w3 = nn.Linear(d, 4 * d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(d)
        self.attention = Attention(d, heads)
        self.ffn_norm = nn.RMSNorm(d)
        self.feed_forward = FeedForward(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, d: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.norm = nn.RMSNorm(d)
        self.output = nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build(a: argparse.Namespace) -> tuple[nn.Module, str]:
    """The model checkpointed and sharded as torchtitan does; the mesh dimension's name."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Transformer(a.width, 4, a.blocks)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
        if a.compile:   # torchtitan compiles each block after checkpointing it
            model.layers[i] = torch.compile(model.layers[i], fullgraph=True)
    mesh, name = None, ""
    if a.mesh == "dp_shard":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        name = "dp_shard"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp)
    for i, layer in enumerate(model.layers):
        # the last block's parameters are gathered again at once by the root's backward
        shard(layer, reshard_after_forward=i < len(model.layers) - 1)
    shard(model)
    return model, name


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mesh", default="default", choices=("default", "dp_shard"))
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    truth, clock = Truth(), CommClock()
    model, name = build(a)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
    g = torch.Generator().manual_seed(rank)     # each rank its own batch
    tokens = torch.randint(0, VOCAB, (a.batch, a.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def forward() -> torch.Tensor:
        return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))

    with clock:
        for i in range(a.iterations):
            truth.begin(i)
            truth.iterations[-1]["clip"] = 0.0
            with clock.iteration(i):
                with clock.phase("forward"):
                    loss = truth.timed("forward", forward)
                with clock.phase("backward"):
                    truth.timed("backward", loss.backward)
                with clock.phase("clip"):
                    truth.timed("clip", lambda: torch.nn.utils.clip_grad_norm_(
                        model.parameters(), 1.0, foreach=True))
                with clock.phase("update"):
                    truth.timed("update", opt.step)
                opt.zero_grad()
            truth.end()
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump({"calls": truth.calls, "iterations": truth.iterations, **clock.dump(),
                   "samples": a.batch, "tokens_per_sample": a.seq, "mesh": name}, f)
    model = opt = loss = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
