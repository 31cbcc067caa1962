"""A GPT-2-shaped language model trained on random tokens (CPU; gloo DDP under torchrun),
timing its own phases with perf_counter: the transformer job of the overhead benchmark and
of the tests that check the analysis against the job's own clock.

    python bench/train_gpt.py OUT.json [--impl auto|hf|torch] [--blocks 12] [--width 128]
                              [--iterations 20] [--batch 4] [--seq 32] [--compile [--compile-backend B]]
                              [--threads N] [--print-loss]

`--impl hf` builds `transformers.GPT2LMHeadModel` from a config (bench/requirements-gpt.txt);
`torch` an equivalent model in plain PyTorch (embeddings, 12 pre-norm blocks of attention
and MLP, tied output layer); `auto`: hf when transformers is installed. AdamW. Per optimizer
step OUT.json gets the loop's own seconds of `forward` (model and loss), `backward`,
`update` and `other` (zero_grad, logging), `start`/`end` (time.time_ns: iterations tile
the loop), and the CPU seconds the step took: `cpu` (the process's threads, ours among them
when recorded) and `main_cpu` (the loop's thread alone), which a busy machine barely moves. `--print-loss` prints each step's loss (rounded), output that does not depend on
timing.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.resid_dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, p)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2's shape in plain PyTorch; returns the logits."""

    def __init__(self, vocab: int, seq: int, d: int, blocks: int, heads: int,
                 p: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.drop = nn.Dropout(p)
        self.h = nn.ModuleList([Block(d, heads, p) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():   # GPT-2's initialization
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(impl: str, vocab: int, seq: int, d: int, blocks: int, heads: int) -> nn.Module:
    if impl == "auto":
        try:
            import transformers  # noqa: F401
            impl = "hf"
        except ImportError:
            impl = "torch"
    if impl == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d, n_layer=blocks,
                         n_head=heads, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    return GPT(vocab, seq, d, blocks, heads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--impl", choices=("auto", "hf", "torch"), default="auto")
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1; 0: torch's default)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile's backend (inductor; aot_eager compiles no C++)")
    p.add_argument("--print-loss", action="store_true")
    a = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.threads or world > 1:
        torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 2) // world))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build(a.impl, a.vocab, a.seq, a.width, a.blocks, a.heads)
    hf = not isinstance(model, GPT)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    if a.compile:
        model = torch.compile(model, backend=a.compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    data = torch.randint(0, a.vocab, (4, a.batch, a.seq + 1), generator=g)

    now = time.perf_counter
    cpu, main_cpu = time.process_time, time.thread_time
    steps = []
    t_prev = time.time_ns()
    for i in range(a.iterations):
        batch = data[i % len(data)]
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        c0, m0 = cpu(), main_cpu()
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
        value = float(loss.detach())
        if a.print_loss:
            print(f"step {i} loss {value:.3f}", flush=True)
        t4 = now()
        t_end = time.time_ns()
        steps.append({"forward": t1 - t0, "backward": t2 - t1, "update": t3 - t2,
                      "other": t4 - t3, "io": 0.0, "h2d": 0.0, "start": t_prev, "end": t_end,
                      "cpu": cpu() - c0, "main_cpu": main_cpu() - m0})
        t_prev = t_end
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.out, "w") as f:
            json.dump(steps, f)
    if world > 1:
        import gc

        import torch.distributed as dist

        # the last all-reduces' works (DDP's reducer) freed on this thread (tests/jobs/ddp_grads.py)
        model = opt = out = logits = loss = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
