"""A small CPU training loop that times itself with perf_counter: the ground truth the
iteration and phase tests compare gputrace's analysis with.

    python timed_loop.py OUT.json [--loader] [--accumulate K] [--eval-every N]
                         [--no-optimizer] [--steps N] [--profile TRACE.json]
                         [--workers N] [--item-sleep-ms MS]

Per optimizer step it writes the loop's own times (seconds, time.time_ns for boundaries):
`io` (waiting for the batch), `h2d` (the copy of the batch), `forward` (model and loss),
`backward`, `update` (optimizer.step), `other` (zero_grad, a logging `.item()` and a sleep
standing in for the loop's bookkeeping), and `start`/`end`: iterations tile the loop, the
next one begins where this one ended. `--profile` runs it under torch.profiler (CPU
activity, a schedule, steps marked with `prof.step()`) and exports the trace. `--workers`:
the loader's worker processes (0: batches made in the loop's own process); `--item-sleep-ms`:
each sample takes that long to load, sleeping (I/O, not CPU) instead of the default short
busy wait. An OUT ending in .jsonl gets the run's steps appended as one line (a job recorded
several times, `gputrace record --repeat`, keeps every run's).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    """Batches that take a while to make (the loop's wait for data is real)."""

    def __init__(self, n: int, cost_s: float, sleep_s: float = 0.0) -> None:
        self.n, self.cost_s, self.sleep_s = n, cost_s, sleep_s
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 512, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
            return self.x[i], self.y[i]
        t = time.perf_counter() + self.cost_s
        while time.perf_counter() < t:
            pass
        return self.x[i], self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--loader", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--no-optimizer", action="store_true")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--profile")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--item-sleep-ms", type=float, default=0.0)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = None if a.no_optimizer else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ds = Slow(a.steps * a.accumulate * a.batch + 64 * a.batch, 0.00002, a.item_sleep_ms / 1e3)
    loader = DataLoader(ds, batch_size=a.batch, num_workers=a.workers)
    fixed = [(ds.x[:a.batch].clone(), ds.y[:a.batch].clone())]
    batches = iter(loader) if a.loader else None
    prof = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile, schedule
        prof = profile(activities=[ProfilerActivity.CPU],
                       schedule=schedule(wait=0, warmup=1, active=a.steps, repeat=1))
        prof.start()
    steps: list[dict[str, float]] = []
    now = time.perf_counter
    t_prev = time.time_ns()
    for step in range(a.steps):
        t = {k: 0.0 for k in ("io", "h2d", "forward", "backward", "update", "other")}
        for _ in range(a.accumulate):
            t0 = now()
            x, y = next(batches) if batches is not None else fixed[0]
            t1 = now()
            x, y = x.clone(), y.clone()          # the copy to the device, on a CPU
            t2 = now()
            loss = loss_fn(model(x), y) / a.accumulate
            t3 = now()
            loss.backward()
            t4 = now()
            t["io"] += t1 - t0
            t["h2d"] += t2 - t1
            t["forward"] += t3 - t2
            t["backward"] += t4 - t3
        t5 = now()
        if opt is not None:
            opt.step()
        t6 = now()
        if opt is not None:
            opt.zero_grad()
        else:
            model.zero_grad()
        float(loss.detach())                     # logging
        time.sleep(0.001)                        # bookkeeping
        t7 = now()
        t["update"] = t6 - t5
        t["other"] = t7 - t6
        if prof is not None:
            prof.step()
        if a.eval_every and (step + 1) % a.eval_every == 0 and batches is not None:
            with torch.no_grad():
                for _ in range(3):
                    xe, _ye = next(batches)
                    model(xe)
        t_end = time.time_ns()
        t["start"], t["end"] = t_prev, t_end
        t_prev = t_end
        steps.append(t)
    if prof is not None:
        prof.stop()
        prof.export_chrome_trace(a.profile)
    with open(a.out, "a" if a.out.endswith(".jsonl") else "w") as f:
        json.dump(steps, f)     # an OUT ending in .jsonl: the run's steps appended as a line
        if a.out.endswith(".jsonl"):
            f.write("\n")


if __name__ == "__main__":
    main()
