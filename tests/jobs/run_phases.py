"""A whole training run that times itself: start-up, training steps, a validation pass every
N steps, checkpoints and the end, the ground truth of the whole-run (goodput) tests.

    python run_phases.py OUT.json [--steps 40] [--eval-every 10] [--eval-batches 4]
                         [--eval-first] [--save-every 0] [--save-mb 0]
                         [--stall-every 0 --stall-ms 0] [--after-step-ms 0] [--ddp]
                         [--async-save] [--log FILE]
                         [--compile [BACKEND]]
    torchrun --nproc-per-node 2 run_phases.py OUT.json --ddp   (OUT.json: one per rank,
                                                                 OUT.rank<R>.json)

A small CNN, a DataLoader with 2 workers for training and one for validation. Its own
clocks (perf_counter, put on time.time_ns once): each training step from its batch request
to the end of its logging (`steps[]`: `start`, `end` ns, and `stepped`: where its
optimizer step returned), each validation pass from the
loader's start to its end (`evals[]`), each save (`saves[]`: `start`, `end`, `bytes`,
`kind`), `init` (init_process_group), `torch_imported` (torch's import returned, on
time.time_ns), the process's start from the kernel (/proc, on CLOCK_BOOTTIME: 10 ms ticks)
and `end` (the last line of main). Single process: `torch.save`
of the model and optimizer at the end (and every `--save-every` steps); `--ddp`: 2 ranks
over gloo, `torch.distributed.checkpoint.save` at the end (`--async-save`: `async_save`
every `--save-every` steps, waited for before the next one). `--save-mb`: a buffer of that many
MB saved with the model (a larger checkpoint). `--stall-every N --stall-ms M`: a sleep of M
ms after every N-th step, outside any phase (`stalls[]`: `start`, `end`; with `--async-save`
also each wait for the previous save before the next one). `--after-step-ms M`: a sleep of M
ms after every step's logging, before its next batch request (a stall right after the step
with nothing recorded between it and the next batch: `stalls[]` too). `--eval-first`: a validation
pass before the first step too (a sanity check, with the optimizer built). OUT ending in
`.jsonl`: the run's truth appended as one line (repeated runs). `--log FILE`: as it goes,
line-buffered (a kill -9 keeps it), `start <process start>` then `step <n> <start> <end>`
per step and `eval <start> <end>` per pass (ns). `--compile [BACKEND]`: the model
`torch.compile`d (with that backend; inductor without one), each step's forward and backward
timed (`steps[].fb`, ns: its compilation is in the first's).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

TORCH_IMPORTED = time.time_ns()     # torch's import returned (its modules above it)


def process_start_ns() -> int:
    """This process's start on time.time_ns's clock, from the kernel's count of ticks since
    boot (CLOCK_BOOTTIME)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    boot, wall = time.clock_gettime_ns(time.CLOCK_BOOTTIME), time.time_ns()
    return wall - (boot - ticks * 10**9 // os.sysconf("SC_CLK_TCK"))


T0_PROCESS = process_start_ns()
_PC0, _WALL0 = time.perf_counter_ns(), time.time_ns()


def now() -> int:
    """perf_counter, on time.time_ns's clock (read once)."""
    return _WALL0 + time.perf_counter_ns() - _PC0


class Images(Dataset):
    def __init__(self, n: int, cost_s: float = 0.0002) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.cost_s = cost_s

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = time.perf_counter() + self.cost_s
        while time.perf_counter() < t:
            pass
        return self.x[i], self.y[i]


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def dir_bytes(path: str, prefix: str = "") -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.startswith(prefix))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--eval-first", action="store_true")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--ckpt-dir")
    p.add_argument("--save-mb", type=int, default=0)
    p.add_argument("--stall-every", type=int, default=0)
    p.add_argument("--stall-ms", type=float, default=0.0)
    p.add_argument("--after-step-ms", type=float, default=0.0)
    p.add_argument("--log")
    p.add_argument("--compile", nargs="?", const="inductor")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    truth: dict = {"process_start": T0_PROCESS, "torch_imported": TORCH_IMPORTED,
                   "steps": [], "evals": [], "saves": [], "stalls": []}
    rank = 0
    ckpt_group = None
    log = open(a.log, "a", buffering=1) if a.log else None   # noqa: SIM115 - to the end
    if log is not None:
        log.write(f"start {T0_PROCESS}\n")
    import torch.distributed as dist
    if a.ddp:
        t0 = now()
        dist.init_process_group("gloo")
        truth["init"] = [t0, now()]
        rank = dist.get_rank()
        # the checkpoint's own group: an async save's collectives run on a background
        # thread, beside DDP's on the default group (one gloo group for both deadlocks)
        ckpt_group = dist.new_group(backend="gloo")
    model = cnn()
    if a.ddp:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    if a.compile:
        model = torch.compile(model, backend=a.compile)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    world = dist.get_world_size() if a.ddp else 1
    train = Images(a.batch * (a.steps + 2) * world)
    val = Images(a.batch * a.eval_batches)
    sampler = None
    if a.ddp:
        from torch.utils.data.distributed import DistributedSampler
        sampler = DistributedSampler(train, shuffle=False)
    loader = DataLoader(train, batch_size=a.batch, num_workers=2, sampler=sampler)
    val_loader = DataLoader(val, batch_size=a.batch, num_workers=1)
    ckpt = a.ckpt_dir or os.path.splitext(a.out)[0] + ".ckpt"
    pending = None        # an async_save's future
    extra = torch.ones(a.save_mb * 2**20 // 4)      # float32: save_mb MiB

    def save(step: int, final: bool) -> None:
        nonlocal pending
        if not a.ddp:
            path = f"{ckpt}.{step}.pt"
            t0 = now()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "extra": extra}, path)
            truth["saves"].append({"kind": "torch.save", "start": t0, "end": now(),
                                   "bytes": os.path.getsize(path)})
            return
        import torch.distributed.checkpoint as dcp
        where = f"{ckpt}.{step}"
        state = {"model": model.state_dict()}
        if pending is not None:     # the loop waits for the last async save: a stall
            t1 = now()
            pending.result()
            truth["stalls"].append({"start": t1, "end": now()})
        t0 = now()
        if a.async_save and not final:
            pending = dcp.async_save(state, checkpoint_id=where, process_group=ckpt_group)
            truth["saves"].append({"kind": "async_save", "start": t0, "end": now()})
            return
        dcp.save(state, checkpoint_id=where, process_group=ckpt_group)
        truth["saves"].append({"kind": "dcp.save", "start": t0, "end": now(),
                               "bytes": dir_bytes(where, f"__{rank}_")})

    def validate() -> None:
        t1 = now()
        model.eval()
        with torch.no_grad():
            for xv, _yv in val_loader:
                model(xv)
        model.train()
        truth["evals"].append({"start": t1, "end": now(), "batches": a.eval_batches})
        if log is not None:
            log.write(f"eval {t1} {truth['evals'][-1]['end']}\n")

    if a.eval_first:
        validate()
    it = iter(loader)
    for step in range(a.steps):
        t0 = now()
        x, y = next(it)
        t1 = now()
        loss = loss_fn(model(x), y)
        loss.backward()
        t2 = now()
        opt.step()
        t3 = now()
        opt.zero_grad()
        float(loss.detach())             # logging
        truth["steps"].append({"step": step, "start": t0, "end": now(), "fb": t2 - t1,
                               "stepped": t3})
        if a.after_step_ms:
            t1 = now()
            time.sleep(a.after_step_ms / 1e3)
            truth["stalls"].append({"start": t1, "end": now()})
        if log is not None:
            log.write(f"step {step} {t0} {truth['steps'][-1]['end']}\n")
        if a.eval_every and (step + 1) % a.eval_every == 0:
            validate()
        if a.save_every and (step + 1) % a.save_every == 0 and step + 1 < a.steps:
            save(step, False)
        if a.stall_every and (step + 1) % a.stall_every == 0 and step + 1 < a.steps:
            t1 = now()
            time.sleep(a.stall_ms / 1e3)
            truth["stalls"].append({"start": t1, "end": now()})
    if pending is not None:
        pending.result()
        pending = None
    save(a.steps, True)
    if a.ddp:
        dist.barrier()
        dist.destroy_process_group()
    truth["end"] = now()
    out = a.out if not a.ddp else f"{os.path.splitext(a.out)[0]}.rank{rank}.json"
    if out.endswith(".jsonl"):      # one line a run (record --repeat)
        with open(out, "a") as f:
            f.write(json.dumps(truth) + "\n")
        return
    with open(out, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main()
