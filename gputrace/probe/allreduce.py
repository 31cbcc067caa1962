"""All-reduce bus bandwidth among local processes: torch.distributed, gloo on CPU, NCCL on GPUs.

Bus bandwidth follows nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n, so it is
comparable with a link's bandwidth whatever the number of processes (the paper's eq. 12).
Run as `python -m gputrace.probe.allreduce` by each worker; `measure` starts them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from gputrace.probe import Plan, figure, median_rate, unavailable

TIMEOUT_S = 180.0


def _gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(backend: str, procs: int, sizes: tuple[int, ...], repeats: int
            ) -> dict[str, Any] | str:
    """Run the workers; rank 0's JSON, or why it failed (one line)."""
    port = _free_port()
    workers = []
    for rank in range(procs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(procs),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GPUTRACE_DISABLE="1")
        if backend == "gloo":
            env.setdefault("OMP_NUM_THREADS", "1")
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "gputrace.probe.allreduce", "--backend", backend,
             "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + TIMEOUT_S
    outs = []
    try:
        for w in workers:
            try:
                outs.append(w.communicate(timeout=max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                return f"the {backend} all-reduce did not finish in {TIMEOUT_S:.0f} s"
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for w, (_, err) in zip(workers, outs, strict=True):
        if w.returncode != 0:
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            return f"{backend} worker failed: {lines[-1] if lines else f'exit {w.returncode}'}"
    try:
        return dict(json.loads(outs[0][0].strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return f"{backend} worker printed no result"


def measure(p: Plan, procs: int | None = None) -> dict[str, dict[str, Any]]:
    if importlib.util.find_spec("torch") is None:
        return {"allreduce_bus": unavailable("torch is not installed (pip install gputrace[torch])")}
    gpus = _gpu_count()
    if procs is None:
        backend, n = ("nccl", gpus) if gpus >= 2 else ("gloo", 2)
    else:
        backend, n = ("nccl" if 2 <= procs <= gpus else "gloo"), procs
    if n < 2:
        return {"allreduce_bus": unavailable("an all-reduce needs at least 2 processes")}
    res = _launch(backend, n, p.allreduce_sizes, p.repeats)
    if isinstance(res, str) and backend == "nccl":
        why = res
        backend, n = "gloo", 2
        res = _launch(backend, n, p.allreduce_sizes, p.repeats)
        if not isinstance(res, str):
            res["note"] = f"NCCL failed ({why}); gloo on the CPU instead"
    if isinstance(res, str):
        return {"allreduce_bus": unavailable(res)}
    factor = 2 * (n - 1) / n
    sweep = [{"bytes": s["bytes"], "median_s": statistics.median(s["seconds"]),
              "busbw_bytes_per_s": median_rate(s["seconds"], s["bytes"], factor)}
             for s in res["sizes"]]
    last = res["sizes"][-1]
    fig = figure(last["seconds"], last["bytes"],
                 f"torch.distributed all_reduce (sum, float32) over {backend} among {n} local "
                 "processes; bus bandwidth = bytes/time * 2(n-1)/n", factor,
                 backend=backend, processes=n,
                 algbw_bytes_per_s=median_rate(last["seconds"], last["bytes"]),
                 sizes=sweep, torch=res.get("torch"))
    if "note" in res:
        fig["note"] = res["note"]
    return {"allreduce_bus": fig}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gputrace.probe.allreduce")
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)

        def sync() -> None:
            torch.cuda.synchronize(device)
    else:
        device = torch.device("cpu")

        def sync() -> None:
            pass
    dist.init_process_group(a.backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S / 2))
    sizes = []
    for nbytes in (int(x) for x in a.sizes.split(",")):
        x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(x)
        sync()
        secs = []
        for _ in range(a.repeats):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            sync()
            secs.append(time.perf_counter() - t0)
        sizes.append({"bytes": x.numel() * 4, "seconds": secs})
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"backend": a.backend, "world": world, "sizes": sizes,
                          "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
