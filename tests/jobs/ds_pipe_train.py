"""A DeepSpeed pipeline job as DeepSpeed's docs write it: a `PipelineModule` of Linear+ReLU
layers split uniformly into one stage per rank, `deepspeed.initialize`, then
`engine.train_batch(data_iter)` per iteration (its TrainSchedule over
gradient_accumulation_steps microbatches), 2 ranks over gloo on the CPU:

    torchrun --nproc_per_node 2 ds_pipe_train.py OUT [--microbatches M] [--iterations N]
                                                     [--layers L] [--width D]
                                                     [--batch B | --global-batch G]

Each stage times its own work per microbatch: its forward (hooks of the job's own on the
stage module), its loss (the last stage's, in the loss function), its backward (from the
gradient's arrival at the stage's output, or the last stage's loss, to its first layer's
gradients, marked with autograd hooks of the job's own); each train_batch with perf_counter;
the engine's forward and backward pass instructions as the engine runs them (autograd and
the engine's own work around it: `passes_s`) and its update instructions (`update_s`). It
counts its collectives at the ProcessGroup (collective_truth) and writes OUT.rank<R>.json
like pp_train.py: {"iterations" (start/end, step_s, passes_s, update_s), "microbatches":
[{"it", "mb", "forward", "loss", "backward"}], "calls", "stage"}."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402
from pp_train import Clock, Mark  # noqa: E402


class FirstMark(Clock):
    """pp_train's clock, its backward from the first mark the gradient reaches (the last
    stage's loss, then its output)."""

    def backward_began(self) -> None:
        if not self.pending:
            super().backward_began()


def time_instructions() -> dict[str, float]:
    """The engine's instructions timed by the job: its forward and backward passes as the
    engine runs them (with the engine's own work around autograd), and its update
    (ReduceTiedGrads, ReduceGrads, OptimizerStep); seconds per train_batch."""
    from deepspeed.runtime.pipe import schedule as sch
    from deepspeed.runtime.pipe.engine import PipelineEngine

    own: dict[str, float] = {"passes": 0.0, "update": 0.0}

    def timed(key: str, fn):
        def run(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                own[key] += time.perf_counter() - t0
        return run

    imap = PipelineEngine._INSTRUCTION_MAP
    for instr, key in ((sch.ForwardPass, "passes"), (sch.BackwardPass, "passes"),
                       (sch.ReduceTiedGrads, "update"), (sch.ReduceGrads, "update"),
                       (sch.OptimizerStep, "update")):
        imap[instr] = timed(key, imap[instr])
    return own


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="rows per microbatch")
    p.add_argument("--global-batch", type=int, default=0,
                   help="rows per iteration (the microbatch: this over --microbatches)")
    a = p.parse_args()
    if a.global_batch:
        a.batch = a.global_batch // a.microbatches
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    clock = FirstMark()
    ce = nn.CrossEntropyLoss()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = ce(out, target)
        clock.loss(time.perf_counter() - t0)
        # the last stage's backward begins at its loss's gradient
        return Mark.apply(loss, clock.backward_began)

    layers = [m for _ in range(a.layers) for m in (nn.Linear(a.width, a.width), nn.ReLU())]
    layers[-2] = nn.Linear(a.width, 10)
    model = PipelineModule(layers=layers, num_stages=world, loss_fn=loss_fn,
                           partition_method="uniform")
    t_fwd = [0.0]
    model.register_forward_pre_hook(lambda m, i: t_fwd.__setitem__(0, time.perf_counter()))

    def fwd_done(m, i, out):
        out = Mark.apply(out, clock.backward_began)
        clock.forward(time.perf_counter() - t_fwd[0])
        return out

    model.register_forward_hook(fwd_done)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    for prm in (first.weight, first.bias):
        prm.register_post_accumulate_grad_hook(clock.grad_done)
    cfg = {"train_micro_batch_size_per_gpu": a.batch,
           "gradient_accumulation_steps": a.microbatches,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           model_parameters=model.parameters())
    own = time_instructions()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.batch, a.width, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)

    def batches():
        while True:
            yield x, y

    data = batches()
    truth = Truth()
    for i in range(a.iterations):
        truth.begin(i)
        clock.begin(i)
        own.update(passes=0.0, update=0.0)
        t0 = time.perf_counter()
        engine.train_batch(data)
        t1 = time.perf_counter()
        truth.end()
        truth.iterations[-1].update({"step_s": t1 - t0, "passes_s": own["passes"],
                                     "update_s": own["update"]})
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump({"calls": truth.calls, "iterations": truth.iterations,
                   "microbatches": clock.mb,
                   "stage": {"index": rank, "stages": world, "schedule": "TrainSchedule",
                             "microbatches": a.microbatches}}, f)
    engine = model = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
