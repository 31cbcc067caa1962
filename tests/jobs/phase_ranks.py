"""A loop of gputrace phases and no framework, run as one rank of several (the launcher sets
RANK and WORLD_SIZE): each iteration's forward makes and holds HOLD_MIB MiB (written, so
resident) until its update. Every rank does the same: a balanced job.

    RANK=r WORLD_SIZE=n python phase_ranks.py [--iterations N]
"""

from __future__ import annotations

import argparse
import time

import gputrace

HOLD_MIB = 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    a = ap.parse_args()
    for _ in range(a.iterations):
        with gputrace.phase("forward"):
            held = b"\x01" * (HOLD_MIB << 20)
        with gputrace.phase("backward"):
            time.sleep(0.002)
        with gputrace.phase("update"):
            del held
        gputrace.step()


if __name__ == "__main__":
    main()
