"""The GPU check's NCCL step: tests/gpu/nccl_job.py (FSDP2, DTensor TP) at world size 1
under `gputrace record`, read back three ways: the job's own count of its collectives, the
trace's GPU records launched inside each recorded collective (by launch time on the
launching thread's process: the NCCL kernels, or NCCL's one-rank copies, a collective
caused; those in the recorded iterations), and `analyze --json`'s `collectives.kinds`.

A collective is attributed when its GPU work is a `comm` record of the same kind (an NCCL
kernel named for it); the figures say how many of the job's collectives were, and what the
GPU records launched inside the others were named.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

READ = r"""
import json, sys
from collections import Counter
from gputrace import load
from gputrace.analyzers.core.collectives import kind_of
rows = load(sys.argv[1]).table.to_pylist()
its = [r for r in rows if r["cat"] == "iteration"]
lo = min((r["start_ns"] for r in its), default=0)
hi = max((r["end_ns"] for r in its), default=0)
host = [r for r in rows if r["cat"] == "comm" and (r["device"] is None or r["device"] < 0)
        and lo <= r["start_ns"] <= hi]
gpu = [r for r in rows if r["cat"] in ("comm", "kernel", "memcpy", "memset")
       and r["device"] is not None and r["device"] >= 0]
inside, attributed, names = Counter(), Counter(), Counter()
for h in host:
    kind = json.loads(h["args"] or "{}").get("kind") or kind_of(h["name"]) or h["name"]
    mine = [g for g in gpu if g["launch_ns"] is not None and g["pid"] == h["pid"]
            and h["start_ns"] <= g["launch_ns"] <= h["end_ns"]]
    inside[kind] += 1
    if any(g["cat"] == "comm" and kind_of(g["name"]) == kind for g in mine):
        attributed[kind] += 1
    for g in mine:
        names[f'{g["cat"]}: {g["name"][:80]}'] += 1
nccl = [g for g in gpu if g["cat"] == "comm"]
print(json.dumps({"host_collectives": dict(inside), "attributed": dict(attributed),
                  "gpu_records_inside": dict(names.most_common(12)),
                  "comm_kernels": len(nccl),
                  "comm_kernels_by_kind": dict(Counter(kind_of(g["name"]) for g in nccl)),
                  "comm_kernels_phase": dict(Counter(g["phase"] for g in nccl))}))
"""


def nccl(ctx: Any, sh: Any, pyjson: Any, free_port: Any) -> dict[str, Any]:
    log = ctx.logs / "nccl.log"
    figures: dict[str, Any] = {}
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("fsdp2", "tp"):
            env = ctx.env(cupti=True, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            env.update({k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
            truth, trace = Path(tmp) / f"{mode}.json", Path(tmp) / f"{mode}.arrow"
            p = sh([sys.executable, "-m", "gputrace", "record", "-q", "--gpu-timeline",
                    "cupti", "-o", str(trace), "--", sys.executable, str(HERE / "nccl_job.py"),
                    str(truth), "--mode", mode, *getattr(ctx, "job_args", [])], env, log)
            if p.returncode != 0 or not truth.exists():
                figures[mode] = {"error": f"record exit {p.returncode}"}
                problems.append(f"{mode}: record exit {p.returncode}")
                continue
            calls = json.loads(truth.read_text())["calls"]
            own = Counter(c["kind"] for c in calls if c["it"] >= 0)
            got = pyjson(READ.replace("sys.argv[1]", repr(str(trace))), env, log)
            a = sh([sys.executable, "-m", "gputrace", "analyze", str(trace), "--json"], env,
                   log)
            kinds = {}
            if a.returncode == 0:
                col = json.loads(a.stdout).get("collectives") or {}
                kinds = {k: {x: v.get(x) for x in ("count", "bytes", "time_s")}
                         for k, v in (col.get("kinds") or {}).items() if isinstance(v, dict)}
            else:
                problems.append(f"{mode}: analyze exit {a.returncode}")
            figures[mode] = {"job_collectives_in_iterations": dict(own),
                             "job_collectives_per_iteration": {
                                 k: v / max(len({c["it"] for c in calls if c["it"] >= 0}), 1)
                                 for k, v in own.items()},
                             "trace": got, "analyze_collectives_kinds_per_iteration": kinds}
            hosts = sum(got["host_collectives"].values())
            if hosts and sum(got["attributed"].values()) < hosts:
                problems.append(f"{mode}: {hosts - sum(got['attributed'].values())} of "
                                f"{hosts} recorded collectives without an NCCL kernel of "
                                f"their kind launched inside")
    out: dict[str, Any] = {"status": "failed" if problems else "ran", "figures": figures}
    if problems:
        out["reason"] = "; ".join(problems)[:600]
    return out
