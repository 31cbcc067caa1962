"""Sampler subprocess for an embedded Session: samples system collectors for a process tree
until that process exits or this one is told to stop (SIGTERM/SIGINT).

    python -m gputrace.record.sampler --pid PID --out SHARD.arrow [--hz N] [--collectors ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

import psutil

from gputrace.collectors import SYSTEM_COLLECTORS, Sampler, Unavailable, make_system_collector
from gputrace.metadata import base_metadata
from gputrace.recorder.clock import Clock
from gputrace.recorder.core import Recorder

# exit code when the samples could not all be written (the Session says so, once)
WRITE_FAILED = 3


def _gone(pid: int) -> bool:
    """The watched process has exited (a zombie not yet reaped has too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gputrace-sampler")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hz", type=float, default=50.0)
    p.add_argument("--collectors", default=",".join(SYSTEM_COLLECTORS))
    # the Session's window (Window.env()) and --max-size: full rate in the window only
    p.add_argument("--window", default="")
    p.add_argument("--max-size", type=int, default=0)
    a = p.parse_args(argv)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    clock = Clock()
    md = base_metadata("sampler", rank=-1)
    md["sample_hz"] = a.hz
    rec = Recorder(a.out, md, clock=clock, quiet=True).start()
    collectors = []
    for name in a.collectors.split(","):
        if name not in SYSTEM_COLLECTORS:
            continue
        try:
            c = make_system_collector(name, a.pid, rec.host)
        except Unavailable as e:
            rec.set_collector(name, f"unavailable: {e}")
            continue
        rec.set_collector(name, "ok", **c.settings())
        collectors.append(c)
    sink: Any = rec
    if a.window or a.max_size:
        from gputrace.record.thin import Thinner, rings

        where = os.path.dirname(os.path.abspath(a.out))
        tail, kept = rings(where, a.max_size, clock) if a.max_size else (None, None)
        sink = Thinner(rec, json.loads(a.window) if a.window else None, where, tail, kept)
    sampler = Sampler(collectors, sink, a.hz, clock.now_ns)
    sampler.start()
    print("ready", flush=True)
    while not stop.wait(0.2):
        if _gone(a.pid):
            break
    sampler.stop()
    if sink is not rec:
        try:
            sink.close()
        except Exception as e:  # noqa: BLE001 - the samples held are lost, said once
            print(f"gputrace: the last samples are lost: {e}", file=sys.stderr)
    for name, why in sampler.failed.items():
        rec.set_collector(name, why)
    rec.metadata["sampler"] = {"hz": a.hz, "achieved_hz": round(sampler.achieved_hz(), 2),
                               "ticks": sampler.ticks,
                               **({"thinned": sink.describe()} if sink is not rec else {})}
    rec.close()
    return WRITE_FAILED if rec.write_error else 0


if __name__ == "__main__":
    os.environ["GPUTRACE_DISABLE"] = "1"
    raise SystemExit(main())
