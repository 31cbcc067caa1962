"""A DeepSpeed ZeRO job as DeepSpeed's docs write it (`deepspeed.initialize`, then
`engine(x)`, `engine.backward(loss)`, `engine.step()`), 2 ranks over gloo on the CPU
(DS_ACCELERATOR=cpu), an MLP of 5 layers with torch's Adam:

    torchrun --nproc_per_node 2 ds_train.py OUT --stage 1|2|3 [--overlap-comm]
                                                [--iterations N] [--width D]
                                                [--bucket N] [--allgather-bucket N]
                                                [--prefetch-bucket N] [--max-live N]

It counts its own collectives at the ProcessGroup (collective_truth), times its forward,
backward and step with perf_counter, after the loop times all-reduces of 4 bytes and of
its gradients' size itself (`probe`: the cost of a call and of a byte on this machine), and
writes OUT.rank<R>.json."""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--overlap-comm", action="store_true")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket", type=int, default=500_000_000)
    p.add_argument("--allgather-bucket", type=int, help="allgather_bucket_size (the "
                   "reduce_bucket_size, --bucket, when not given)")
    p.add_argument("--prefetch-bucket", type=int, help="stage3_prefetch_bucket_size")
    p.add_argument("--max-live", type=int, help="stage3_max_live_parameters")
    a = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(a.width, a.width),
                                                          nn.ReLU())],
                          nn.Linear(a.width, 10))
    cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": a.stage, "overlap_comm": a.overlap_comm,
                                 "reduce_bucket_size": a.bucket,
                                 "allgather_bucket_size": a.allgather_bucket or a.bucket},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
           "wall_clock_breakdown": False}
    for key, v in (("stage3_prefetch_bucket_size", a.prefetch_bucket),
                   ("stage3_max_live_parameters", a.max_live)):
        if v is not None:
            cfg["zero_optimization"][key] = v
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.batch, a.width, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    truth = Truth()
    for i in range(a.iterations):
        truth.begin(i)
        loss = truth.timed("forward", lambda: loss_fn(engine(x), y))
        truth.timed("backward", engine.backward, loss)
        truth.timed("update", engine.step)
        truth.end()
    truth.probe = probe(sum(q.numel() for q in model.parameters()))
    truth.dump(f"{a.out}.rank{rank}.json")
    engine = model = opt = loss = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def probe(elements: int, n: int = 9) -> dict:
    """Median seconds of one synchronous all-reduce of 4 bytes and of `elements` floats,
    each call begun together by the ranks (a barrier before it): the median, as a rank
    preempted in one call (a busy machine) makes that call alone slow; and the fastest
    (`small_min_s`, `large_min_s`): a call neither rank was preempted in, where most were
    (beside two CPU hogs the median of the 4-byte call was 1.39 ms)."""
    out = {"elements": elements}
    for key, x in (("small_s", torch.zeros(1)), ("large_s", torch.zeros(elements))):
        took = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            took.append(time.perf_counter() - t0)
        out[key] = statistics.median(took)
        out[key.replace("_s", "_min_s")] = min(took)
    return out


if __name__ == "__main__":
    main()
