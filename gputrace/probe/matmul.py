"""Dense matmul FLOP/s: the peaks MFU is measured against where no vendor figure is known
(and beside it where one is). fp32 on the CPU (torch's threads as the job would use them);
fp32, tf32, bf16 and fp16 on each GPU, timed with CUDA events. A figure's `flops_per_s` is
the best repeat (a peak), `median_flops_per_s` the median; `n` the square matrices' size."""

from __future__ import annotations

import statistics
import time
from typing import Any

from gputrace.probe import unavailable

CPU_N = {"quick": 1024, "full": 2048}
GPU_N = {"quick": 8192, "full": 16384}
REPEATS = {"quick": 8, "full": 20}
# the CPU's products repeat for at least these seconds too: a shared machine's best of a few
# tens of ms moves by a fifth from one probe to the next
CPU_MIN_S = {"quick": 1.0, "full": 3.0}


def _figure(seconds: list[float], n: int, method: str, **extra: Any) -> dict[str, Any]:
    rates = sorted(2.0 * n ** 3 / s for s in seconds if s > 0)
    if not rates:
        return unavailable("no timed repeat")
    return {"status": "ok", "flops_per_s": rates[-1], "median_flops_per_s":
            statistics.median(rates), "min_flops_per_s": rates[0], "repeats": len(rates),
            "n": n, "method": method, **extra}


def cpu(mode: str = "quick", n: int | None = None, repeats: int | None = None
        ) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return unavailable("torch is not installed")
    n = n or CPU_N.get(mode, 1024)
    repeats = repeats or REPEATS.get(mode, 8)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)   # warm-up: threads started, pages touched
    secs: list[float] = []
    least = CPU_MIN_S.get(mode, 1.0)
    while len(secs) < repeats or (sum(secs) < least and len(secs) < 1000):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        secs.append(time.perf_counter() - t0)
    return _figure(secs, n, f"torch.matmul {n}x{n} fp32, best of {len(secs)}",
                   threads=torch.get_num_threads(), device="cpu", dtype="fp32")


def gpu(mode: str = "quick") -> dict[str, dict[str, Any]]:
    """Each GPU dtype's figure on GPU 0 (every GPU of a node is the same part)."""
    keys = ("fp32", "tf32", "bf16", "fp16")
    try:
        import torch
    except ImportError:
        return {f"matmul_gpu_{k}": unavailable("torch is not installed") for k in keys}
    if not torch.cuda.is_available():
        return {f"matmul_gpu_{k}": unavailable("no CUDA GPU") for k in keys}
    n, repeats = GPU_N.get(mode, 8192), REPEATS.get(mode, 8)
    dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
              "fp16": torch.float16}
    out: dict[str, dict[str, Any]] = {}
    prev = torch.backends.cuda.matmul.allow_tf32
    try:
        for k in keys:
            if k == "bf16" and not torch.cuda.is_bf16_supported():
                out[f"matmul_gpu_{k}"] = unavailable("this GPU has no bf16")
                continue
            torch.backends.cuda.matmul.allow_tf32 = k == "tf32"
            a = torch.randn(n, n, device="cuda", dtype=dtypes[k])
            b = torch.randn(n, n, device="cuda", dtype=dtypes[k])
            for _ in range(3):
                torch.matmul(a, b)
            torch.cuda.synchronize()
            secs = []
            for _ in range(repeats):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                torch.matmul(a, b)
                e.record()
                e.synchronize()
                secs.append(s.elapsed_time(e) / 1e3)
            out[f"matmul_gpu_{k}"] = _figure(
                secs, n, f"torch.matmul {n}x{n} {k} on cuda:0, CUDA events, best of {repeats}",
                device=torch.cuda.get_device_name(0), dtype=k)
            del a, b
    except Exception as e:  # noqa: BLE001 - out of memory, a driver error: said, not raised
        out.update({f"matmul_gpu_{k}": unavailable(f"{type(e).__name__}: {e}")
                    for k in keys if f"matmul_gpu_{k}" not in out})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


def measure(mode: str = "quick") -> dict[str, dict[str, Any]]:
    return {"matmul_cpu_fp32": cpu(mode), **gpu(mode)}
