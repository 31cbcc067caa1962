"""What one recorded span costs the training loop: gputrace's PyTorch hooks and its flush
thread, timed on a model so small that the framework, not compute, fills each iteration.

Runs the same loop (forward, backward, optimizer step of --layers tiny Linear layers, one
thread) plain, then with `gputrace.torch.instrument` on an in-process Session, taking the
fastest of --blocks blocks of --iterations each; the difference over the spans recorded per
iteration is the cost of a span. Also counts the Python calls (functions and builtins) the
loop's thread makes per iteration, plain and instrumented, under `sys.setprofile`: the
calls per span are exact where the time is at the mercy of the machine. Prints JSON. The fastest block is the one least disturbed
by the rest of a shared machine, which makes this far steadier than timing a real model.

    python bench/hookcost.py [--layers 20] [--iterations 300] [--blocks 9]
    python bench/hookcost.py --compare REF [--rounds 5] [--together]

--compare runs the measurement of this tree and of gputrace at git revision REF (e.g. the
commit before a change) in alternating subprocesses, --rounds each, and prints both side
by side: median cost per span and the ratio. With --together the two run at the same time
on one core, each in its own session (see bench/common.py), so the host's drift, which
moves a block here by 2x between minutes, hits both alike; a span's cost is then taken
against the plain blocks of both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _together(trees: dict[str, str], child: list[str], core: int) -> dict[str, dict]:
    """One measurement of each tree, all at once on `core`, each in its own session; each
    span's cost taken against the mean of their plain blocks (run side by side)."""
    from common import together

    outs = together([([sys.executable, __file__, *child], core) for _ in trees],
                     envs=[{"PYTHONPATH": path} for path in trees.values()])
    got = {name: json.loads(out.splitlines()[-1]) for name, out in zip(trees, outs,
                                                                       strict=True)}
    plain = statistics.mean(r["plain_us"] for r in got.values())
    for r in got.values():
        r["us_per_span"] = (r["instrumented_us"] - plain) / r["spans_per_iteration"]
    return got


def compare(ref: str, rounds: int, child: list[str], together: bool = False) -> None:
    """This tree's cost per span beside REF's, measured in alternating subprocesses (or
    side by side on one core)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "gputrace"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        trees = {f"{ref}": tmp, "this tree": str(ROOT)}
        got: dict[str, list[dict]] = {k: [] for k in trees}
        for r in range(rounds):
            if together:
                for name, res in _together(trees, child, r % 2).items():
                    got[name].append(res)
                continue
            for name, path in trees.items():
                p = subprocess.run([sys.executable, __file__, *child], capture_output=True,
                                   text=True, check=True,
                                   env=dict(os.environ, PYTHONPATH=path))
                got[name].append(json.loads(p.stdout.splitlines()[-1]))
    med = {k: statistics.median(r["us_per_span"] for r in v) for k, v in got.items()}
    calls = {k: v[0].get("calls_per_span") for k, v in got.items()}
    for name, runs in got.items():
        each = ", ".join(f"{r['us_per_span']:.2f}" for r in runs)
        print(f"{name:>12}: {med[name]:6.2f} us per span (rounds: {each}; "
              f"{runs[0]['spans_per_iteration']:.1f} spans per iteration), "
              f"{calls[name]:.1f} Python calls per span on the loop's thread")
    print(f"this tree / {ref}: time {med['this tree'] / med[ref]:.2f}x, "
          f"calls {calls['this tree'] / calls[ref]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--compare", metavar="REF", help="also measure gputrace at git REF")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--together", action="store_true",
                    help="with --compare: both at once on one core")
    a = ap.parse_args()
    if a.compare:
        compare(a.compare, a.rounds, ["--layers", str(a.layers), "--iterations",
                                      str(a.iterations), "--blocks", str(a.blocks)],
                a.together)
        return

    import torch

    import gputrace
    import gputrace.torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(a.layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)

    def block() -> float:
        t = time.perf_counter()
        for _ in range(a.iterations):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return (time.perf_counter() - t) / a.iterations

    def calls(n: int = 20) -> float:
        """Python-level calls (functions and builtins) on the loop's thread per iteration:
        deterministic where the machine's speed is not."""
        count = [0]

        def prof(frame: Any, event: str, arg: Any) -> None:
            if event == "call" or event == "c_call":
                count[0] += 1

        sys.setprofile(prof)
        try:
            for _ in range(n):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
        finally:
            sys.setprofile(None)
        return count[0] / n

    block()   # warm-up
    plain_calls = calls()
    plain = min(block() for _ in range(a.blocks))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.arrow")
        with gputrace.Session(path, sampler=False) as s:
            gputrace.torch.instrument(session=s, gpu_timeline=None)
            block()
            timed = min(block() for _ in range(a.blocks))
            timed_calls = calls()
        table = gputrace.load(path).table
    its = table.filter(table.column("cat").cast("string").to_numpy(zero_copy_only=False)
                       == "iteration").num_rows
    spans = table.filter(table.column("kind").cast("string").to_numpy(zero_copy_only=False)
                         == "span").num_rows
    per_iter = spans / max(its, 1)
    print(json.dumps({"plain_us": plain * 1e6, "instrumented_us": timed * 1e6,
                      "spans_per_iteration": per_iter,
                      "us_per_span": (timed - plain) * 1e6 / per_iter if per_iter else None,
                      "calls_per_span": (timed_calls - plain_calls) / per_iter
                      if per_iter else None}))


if __name__ == "__main__":
    main()
