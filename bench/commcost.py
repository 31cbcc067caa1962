"""What recording a collective costs the job, against what a phase span costs it today.

On a one-process gloo group with tiny tensors (the call itself, not the transfer, is timed),
inside an in-process Session with gputrace.torch.instrument, blocks of --calls calls through
torch.distributed's original functions and through gputrace's wrappers alternate; the
fastest block of each is kept (the least disturbed by the rest of a shared machine). The
cost of one recorded phase span (bench/hookcost.py: hooks and flush, on a tiny model) is
measured in the same run, in a process of its own, for comparison.

    python bench/commcost.py [--calls 1000] [--blocks 9] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--tiny", action="store_true", help="a smoke run (100 calls, 2 blocks)")
    a = ap.parse_args()
    if a.tiny:
        a.calls, a.blocks = 100, 2

    import torch
    import torch.distributed as dist

    import gputrace
    import gputrace.torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(16)
    out = torch.empty(16)

    def sync() -> None:
        dist.all_reduce(x)

    def gather() -> None:
        dist.all_gather_single(out, x)

    def waited() -> None:
        dist.all_reduce(x, async_op=True).wait()

    cases = {"all_reduce": sync, "all_gather_single": gather, "all_reduce async + wait": waited}

    from torch.distributed import Work

    from gputrace.collectors.torch import comm as torch_comm

    with tempfile.TemporaryDirectory() as tmp:
        with gputrace.Session(os.path.join(tmp, "t.arrow"), sampler=False) as s:
            gputrace.torch.instrument(session=s, gpu_timeline=None)
            wrapped_wait = Work.wait
            names = ("all_reduce", "all_gather_single")
            wrapped = {n: getattr(dist, n) for n in names}
            plain = dict.fromkeys(cases, float("inf"))
            recorded = dict.fromkeys(cases, float("inf"))
            for _ in range(a.blocks):
                for use_orig in (True, False):
                    for n in names:
                        setattr(dist, n, wrapped[n]._gputrace_orig if use_orig else wrapped[n])
                    Work.wait = wrapped_wait._gputrace_orig if use_orig else wrapped_wait
                    for k, fn in cases.items():
                        t = time.perf_counter()
                        for _ in range(a.calls):
                            fn()
                        dt = (time.perf_counter() - t) / a.calls
                        into = plain if use_orig else recorded
                        into[k] = min(into[k], dt)
            assert torch_comm._pending == {}
    dist.destroy_process_group()
    hook = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__),
                                                        "hookcost.py"),
                           "--iterations", "50" if a.tiny else "200",
                           "--blocks", str(a.blocks)],
                          capture_output=True, text=True, check=True)
    per_span = json.loads(hook.stdout)["us_per_span"] / 1e6
    rows = [[k, f"{plain[k] * 1e6:.1f}", f"{recorded[k] * 1e6:.1f}",
             f"{(recorded[k] - plain[k]) * 1e6:.1f}",
             f"{(recorded[k] - plain[k]) / per_span:.1f}x"] for k in cases]
    print("machine:", machine())
    print(table(f"Cost of a recorded collective (fastest of {a.blocks} blocks of {a.calls} "
                f"calls each way; one recorded phase span, hookcost.py: "
                f"{per_span * 1e6:.1f} us)",
                ["call", "plain us", "recorded us", "added us", "added / span"], rows))


if __name__ == "__main__":
    main()
