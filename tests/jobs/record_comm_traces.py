"""Record the collective jobs of this folder with `gputrace record` (2 ranks over gloo on the
CPU), each beside its own truth:

    python tests/jobs/record_comm_traces.py OUT_DIR [NAME ...]

NAME: fsdp2 (fully_shard, reshard_after_forward=True), fsdp2-keep (False), fsdp2-prefetch
(explicit prefetch of the next/previous block, asynchronous all-gathers), fsdp2-hsdp
(replicated on a 2x1 mesh: HSDP's gradient all-reduce), fsdp1
(FullyShardedDataParallel per block), moe (all_gather, broadcast, all_to_all, async
all_to_all_single and all_reduce, send/recv), tour (every other call once per iteration, then a failure of the recorder's
own bookkeeping); all of them when none is given. Writes
OUT_DIR/NAME.arrow and, per rank, OUT_DIR/NAME.rank<R>.json (the job's own collectives,
iterations and phase times: tests/jobs/collective_truth.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

JOBS = Path(__file__).resolve().parent
CONFIGS = {
    "fsdp2": ("fsdp_train.py", "--mode", "fsdp2"),
    "fsdp2-keep": ("fsdp_train.py", "--mode", "fsdp2-keep"),
    "fsdp2-prefetch": ("fsdp_train.py", "--mode", "fsdp2-prefetch"),
    "fsdp2-hsdp": ("fsdp_train.py", "--mode", "fsdp2-hsdp"),
    "fsdp1": ("fsdp_train.py", "--mode", "fsdp1"),
    "moe": ("moe_exchange.py",),
    "tour": ("collective_tour.py", "--break"),
}


# fsdp2-prefetch's test compares the all-gathers with the blocks' forward spans
RECORD_OPTS = {"fsdp2-prefetch": ["--layer-forward"]}


def command(name: str, out_dir: Path, iterations: int | None = None) -> list[str]:
    script, *args = CONFIGS[name]
    return [sys.executable, "-m", "gputrace", "record", "-f", *RECORD_OPTS.get(name, []), "-o",
            str(out_dir / f"{name}.arrow"), "--", sys.executable, "-m",
            "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(JOBS / script), str(out_dir / name), *args,
            *(["--iterations", str(iterations)] if iterations else [])]


def record(name: str, out_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Record one configuration; the environment's PYTHONPATH is kept (the source tree).
    Recorded again, once, where a rank was aborted by torch at its exit (exit_abort)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    root = str(JOBS.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    p = subprocess.run(command(name, out_dir), capture_output=True, text=True,
                       timeout=timeout, env=env)
    if exit_abort(p):
        print(f"{name}: a rank aborted at its exit (torch's, see exit_abort); recorded again",
              file=sys.stderr)
        p = subprocess.run(command(name, out_dir), capture_output=True, text=True,
                           timeout=timeout, env=env)
    return p


def exit_abort(p: subprocess.CompletedProcess[str]) -> bool:
    """Whether the job failed only as torch 2.13 aborts a gloo job at its exit: a gloo thread
    taking the GIL as the interpreter finalizes ("terminate called without an active
    exception", SIGABRT), after every rank finished its work. collective_tour.py (no
    backward, so not what collectors/torch/waiter.py keeps out) did so once in a suite run
    and, not recorded, once in 64 runs beside recorded ones (0 of 117 alone). Told only of
    a job whose two ranks both printed that their work was right (the tour's `RESULT ok`)."""
    return (p.returncode != 0 and "terminate called without an active exception" in p.stderr
            and "(SIGABRT)" in p.stderr and p.stdout.count("RESULT ok") == 2)


def main() -> None:
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1])
    for name in sys.argv[2:] or list(CONFIGS):
        p = record(name, out)
        print(f"{name}: exit {p.returncode} -> {out / (name + '.arrow')}")
        if p.returncode:
            print(p.stderr[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()
