"""A training loop that knows its own FLOPs and times its own layers.

    python flops_train.py OUT [--model mlp|block] [--checkpoint] [--steps N]

mlp: four Linear layers (an nn.Sequential); block: two transformer-like blocks (an
nn.ModuleList: q/k/v and output projections, attention as explicit batched matmuls, a
4x MLP). Every product is counted here as 2*m*n*k FLOPs; a backward computes the
gradients of both operands of each product (twice the forward) except for the input of the
first layer, which needs none. --checkpoint recomputes the last block's forward in the
backward (torch.utils.checkpoint): hardware FLOPs = model FLOPs + that block's forward; the
first block is not checkpointed, so its own counts stay exact.

Each layer's forward is timed with perf_counter in a forward pre-hook and hook. Writes OUT
as JSON: {"layers": [{"name", "flops_f", "flops_b", "forward_s": [per step]}], "flops_f",
"flops_b", "recompute", "iterations": [seconds per step], "losses": [per step],
"param_sums": [the parameters' sum after each step], "step_ends": [perf_counter after each
optimizer step: the iterations tile the loop, so iteration k > 0 is step_ends[k] -
step_ends[k - 1]]}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

BATCH, WIDTH = 128, 512                  # mlp
SEQ, DIM, HEADS, SEQS = 64, 128, 4, 2    # block: SEQS sequences of SEQ tokens


def mm(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // HEADS
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, HEADS, hd).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / hd ** 0.5, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(torch.relu(self.fc1(x)))

    @staticmethod
    def flops() -> int:
        n = SEQS * SEQ
        return (mm(n, 3 * DIM, DIM) + mm(n, DIM, DIM) + 2 * mm(n, 4 * DIM, DIM)
                + 2 * SEQS * HEADS * mm(SEQ, SEQ, DIM // HEADS))

    @staticmethod
    def input_grad_flops() -> int:
        """The backward's FLOPs for the gradient of the block's input (qkv's)."""
        return mm(SEQS * SEQ, 3 * DIM, DIM)


class Blocks(nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            if self.ckpt and i == len(self.blocks) - 1:
                # the whole forward again (early stop would leave its end out)
                with set_checkpoint_early_stop(False):
                    x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return x


def build(kind: str, ckpt: bool) -> tuple[nn.Module, list[nn.Module], list[dict], torch.Tensor]:
    if kind == "mlp":
        dims = [WIDTH, WIDTH, WIDTH, WIDTH, 256]
        mods: list[nn.Module] = []
        for i in range(len(dims) - 1):
            mods += [nn.Linear(dims[i], dims[i + 1]), nn.ReLU()]
        model = nn.Sequential(*mods)
        layers = [m for m in model if isinstance(m, nn.Linear)]
        truth = []
        for i, m in enumerate(layers):
            f = mm(BATCH, m.out_features, m.in_features)
            truth.append({"name": "Linear", "flops_f": f, "flops_b": f if i == 0 else 2 * f})
        return model, layers, truth, torch.randn(BATCH, WIDTH)
    model = Blocks(ckpt)
    layers = list(model.blocks)
    f = Block.flops()
    truth = [{"name": "Block", "flops_f": f,
              "flops_b": 2 * f - (Block.input_grad_flops() if i == 0 else 0)}
             for i in range(len(layers))]
    return model, layers, truth, torch.randn(SEQS, SEQ, DIM)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", choices=("mlp", "block"), default="mlp")
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, layers, truth, x = build(a.model, a.checkpoint)
    per_layer: list[list[float]] = [[0.0] * a.steps for _ in layers]
    step = [0]
    starts: dict[int, float] = {}

    def pre(i: int):  # noqa: ANN202
        def hook(mod, args) -> None:  # noqa: ANN001
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() == -1:
                starts[i] = time.perf_counter()
        return hook

    def post(i: int):  # noqa: ANN202
        def hook(mod, args, out) -> None:  # noqa: ANN001
            if i in starts:    # a recomputation inside the backward is not the forward
                per_layer[i][step[0]] += time.perf_counter() - starts.pop(i)
        return hook

    for i, m in enumerate(layers):
        m.register_forward_pre_hook(pre(i))
        m.register_forward_hook(post(i))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    its, losses, sums, ends = [], [], [], []
    for s in range(a.steps):
        step[0] = s
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        ends.append(time.perf_counter())
        its.append(ends[-1] - t0)
        losses.append(loss.item())
        with torch.no_grad():
            sums.append(sum(float(p.double().sum()) for p in model.parameters()))
    recompute = truth[-1]["flops_f"] if a.checkpoint else 0
    for t, times in zip(truth, per_layer, strict=True):
        t["forward_s"] = times
    with open(a.out, "w") as f:
        json.dump({"layers": truth, "flops_f": sum(t["flops_f"] for t in truth),
                   "flops_b": sum(t["flops_b"] for t in truth), "recompute": recompute,
                   "iterations": its, "threads": torch.get_num_threads(),
                   "losses": losses, "param_sums": sums, "step_ends": ends}, f)


if __name__ == "__main__":
    main()
