"""A PyTorch training loop whose layers launch their work on a device played out in real time
(tests/fakes/cupti.py), recorded by gputrace's torch auto-instrumentation and CUPTI
collector inside a harness Session: the same code paths as a CUDA run, on the CPU.

    python fake_gpu_torch.py OUT.arrow TRUTH.json [--accumulate K] [--steps N] [--loader]
                                                  [--window START:COUNT]

Each layer launches a forward kernel in its forward and a backward kernel in its backward
(a custom autograd function); the loss is launched outside the model; the optimizer's step
launches its kernels; the batch is copied to the device before the forward, outside any
phase. TRUTH.json: every record the device ran, with the label of the phase it was launched
in and the loop's step; per step, CUDA-event times of each phase, the wait for the batch
(host), the step's end (host), and the activity kinds CUPTI had enabled once its forward
ran (`kinds`). `--window`: the Session records that window only (as `record --steps`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gputrace  # noqa: E402
import gputrace.torch as gt  # noqa: E402
from gputrace.collectors.cupti import CuptiCollector  # noqa: E402
from tests.fakes.cupti import FakeCupti, FakeDevice  # noqa: E402

MS = 1_000_000
cu = FakeCupti()
dev = FakeDevice(cu)
tags: list[int] = []
step_now = [0]
_enqueue = dev._enqueue


def _tagged(*a, **k):  # type: ignore[no-untyped-def]
    out = _enqueue(*a, **k)
    tags.append(step_now[0])
    return out


dev._enqueue = _tagged  # type: ignore[method-assign]


class OnDevice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ms):  # type: ignore[no-untyped-def]
        ctx.ms = ms
        dev.kernel("fwd_gemm", int(ms * MS), "forward")
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        dev.kernel("bwd_gemm", int(2 * ctx.ms * MS), "backward")
        return g, None


class Layer(torch.nn.Linear):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return OnDevice.apply(super().forward(x), 0.4)


class SGD(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for _ in range(2):
            dev.kernel("sgd_update", int(1.0 * MS), "update")
        return super().step(closure)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("truth")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--loader", action="store_true")
    p.add_argument("--window")
    a = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(Layer(64, 64), torch.nn.ReLU(), Layer(64, 64), Layer(64, 10))
    opt = SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(32, 64), torch.randint(0, 10, (32,)))
            for _ in range(a.steps * a.accumulate)]
    batches = iter(torch.utils.data.DataLoader(data, batch_size=None)) if a.loader else \
        iter(data)
    with gputrace.Session(a.out, sampler=False, steps=a.window) as s:
        col = CuptiCollector(s.recorder, cupti=cu)
        col.start()
        gt.instrument(model, opt, session=s, gpu_timeline=None)
        events = []
        for k in range(a.steps):
            step_now[0] = k
            ev = dict.fromkeys(("h2d", "forward", "backward", "update", "io"), 0)
            for _ in range(a.accumulate):
                t_io = time.perf_counter_ns()
                x, y = next(batches)
                ev["io"] += time.perf_counter_ns() - t_io
                copy: list[tuple[int, int]] = []
                dev.h2d(4 << 20, pinned=False, label="h2d", events=copy)  # x.to("cuda")
                e0, e_copied = copy[0]
                e1 = dev.event()
                out = model(x)
                ev["kinds"] = len(cu.enabled)
                dev.kernel("cross_entropy", int(0.1 * MS), "forward")
                loss = torch.nn.functional.cross_entropy(out, y) / a.accumulate
                e2 = dev.event()
                loss.backward()
                e3 = dev.event()
                ev["h2d"] += e_copied - e0
                ev["forward"] += e2 - e1
                ev["backward"] += e3 - e2
            e4 = dev.event()
            opt.step()
            ev["update"] = dev.event() - e4
            opt.zero_grad()
            ev["end"] = time.time_ns()
            events.append(ev)
        dev.synchronize()
    with open(a.truth, "w") as f:
        json.dump({"ran": [[t, lb, st, en] for t, (lb, st, en) in zip(tags, dev.ran,
                                                                      strict=True)],
                   "events": events}, f)


if __name__ == "__main__":
    main()
