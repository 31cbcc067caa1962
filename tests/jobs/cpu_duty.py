"""A process that keeps one core busy part of the time, logging its own CPU time: spins
for --busy seconds, sleeps for --idle seconds, over --seconds, and writes argv[1] (JSON):
[[time.time(), time.process_time()], ...] every few milliseconds while it spins and
on either side of each sleep, so its CPU time at any moment is interpolated from the log.

    python cpu_duty.py OUT.json [--seconds 8] [--busy 0.3] [--idle 0.3]
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--busy", type=float, default=0.3)
    p.add_argument("--idle", type=float, default=0.3)
    a = p.parse_args()
    log = [[time.time(), time.process_time()]]
    end = time.time() + a.seconds
    while time.time() < end:
        until = time.time() + a.busy
        while time.time() < until:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.002:
                pass
            log.append([time.time(), time.process_time()])
        time.sleep(a.idle)
        log.append([time.time(), time.process_time()])
    with open(a.out, "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()
