"""What recording a collective costs the job: torch.distributed calls timed plain and then
recorded (gputrace.torch.instrument on an in-process Session), side by side in one run, on
a one-process gloo group with tiny tensors so the call itself, not the transfer, is what is
timed. Also the cost of one `Recorder.span` (what a phase span costs today), measured in the
same run, for comparison. Fastest of --blocks blocks of --calls each.

    python bench/commcost.py [--calls 2000] [--blocks 7] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="a smoke run (200 calls, 2 blocks)")
    a = ap.parse_args()
    if a.tiny:
        a.calls, a.blocks = 200, 2

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

    def fastest(fn) -> float:
        best = float("inf")
        for _ in range(a.blocks):
            t = time.perf_counter()
            for _ in range(a.calls):
                fn()
            best = min(best, (time.perf_counter() - t) / a.calls)
        return best

    plain = {k: fastest(f) for k, f in cases.items()}
    with tempfile.TemporaryDirectory() as tmp:
        with gputrace.Session(os.path.join(tmp, "t.arrow"), sampler=False) as s:
            gputrace.torch.instrument(session=s, gpu_timeline=None)
            rec = s.recorder
            recorded = {k: fastest(f) for k, f in cases.items()}

            def span() -> None:
                rec.span("forward", "Linear", 0, 1, layer=1, args='{"layers":[1]}')

            per_span = fastest(span)
    dist.destroy_process_group()
    rows = [[k, f"{plain[k] * 1e6:.1f}", f"{recorded[k] * 1e6:.1f}",
             f"{(recorded[k] - plain[k]) * 1e6:.1f}",
             f"{(recorded[k] - plain[k]) / per_span:.1f}x"] for k in cases]
    print(machine())
    print(table(f"Cost of a recorded collective (fastest of {a.blocks} x {a.calls} calls; "
                f"one Recorder.span with args: {per_span * 1e6:.2f} us)",
                ["call", "plain us", "recorded us", "added us", "added / span"], rows))


if __name__ == "__main__":
    main()
