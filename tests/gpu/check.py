"""The GPU check: every GPU figure gputrace claims, measured in one command on a GPU machine.

    tests/gpu/check.sh DIR [--dry] [--only STEP,...]      (make gpu-check OUT=DIR)

Steps, in order, each in a subprocess of its own with a time box (its process group is
killed at the box, recorded as failed with `timed_out`, and the next step runs):

    install          gputrace and the wheels it lacks, from WHEELS, into a fresh target
    environment      nvidia-smi, torch / CUDA / CUPTI versions, whether CUPTI can be enabled
    gpu_tests_cupti  pytest -m gpu (but the truth loop) with cupti-python
    gpu_tests_kineto pytest -m gpu without cupti-python (torch.profiler's Kineto fallback)
    truth_loop       tests/test_gpu_truth.py against the CUDA loop's CUDA events, -k window too
    cnn_cuda         samples/train_cnn.py --device cuda recorded; the share in no phase
    capture          GPUTRACE_CAPTURE_FIXTURES=1 ... -k capture, the fixtures into DIR
    overhead         plain vs recorded with CUPTI, interleaved rounds (tests/gpu/overhead.py)
    nccl             FSDP2 and DTensor TP at world size 1 over NCCL (tests/gpu/nccl_job.py)

Without a GPU (no nvidia-smi, or torch without CUDA) each GPU step is skipped with the
reason, and the rest really runs. DIR/summary.json: each step's status (ran, skipped,
failed), reason, figures and wall time. The boxes add up to at most TOTAL_S; a step that
ends early leaves its time to the next. GPUTRACE_GPU_CHECK_BOXES="step=seconds,..." sets
a step's box (the CPU test forces a small one).

Environment: PYTHON (the interpreter, default python3: the machine's own, with its torch),
GPU_WHEELS (default build/gpu-wheels, made by `make gpu-wheels`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOTAL_S = 420.0   # 7 minutes on a GPU machine, every box included

# (name, base box in seconds, needs a GPU)
STEPS: list[tuple[str, float, bool]] = [
    ("install", 20, False),
    ("environment", 30, False),
    ("gpu_tests_cupti", 40, True),
    ("gpu_tests_kineto", 45, True),
    ("truth_loop", 90, True),
    ("cnn_cuda", 25, True),
    ("capture", 35, True),
    ("overhead", 90, True),
    ("nccl", 40, True),
]
assert sum(b for _, b, _ in STEPS) <= TOTAL_S


def boxes_from_env() -> dict[str, float]:
    out: dict[str, float] = {}
    spec = os.environ.get("GPUTRACE_GPU_CHECK_BOXES", "")
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in {s[0] for s in STEPS}:
            raise SystemExit(f"GPUTRACE_GPU_CHECK_BOXES: no step {name!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"GPUTRACE_GPU_CHECK_BOXES: {part!r} is not step=seconds"
                             ) from None
    return out


def run_boxed(cmd: list[str], box_s: float, env: dict[str, str], log: Path
              ) -> tuple[int | None, float]:
    """Run `cmd` in a process group of its own, output into `log`; kill the group at
    `box_s`. Returns (exit code or None when killed, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc: int | None = p.wait(timeout=box_s)
        except subprocess.TimeoutExpired:
            kill_tree(p)
            rc = None
    return rc, time.perf_counter() - t0


def kill_tree(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the step's process group and to every process under it (`gputrace
    record` starts its job in a group of its own), SIGKILL to those left after 5 s."""
    try:
        import psutil
        procs = psutil.Process(p.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil, or the step already gone
        procs = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        for child in procs:
            try:
                child.send_signal(sig)
            except Exception:  # noqa: BLE001 - gone already
                pass
        try:
            p.wait(timeout=5)
            if sig == signal.SIGTERM and procs:
                import psutil
                procs = psutil.wait_procs(procs, timeout=5)[1]
            if not procs:
                return
        except subprocess.TimeoutExpired:
            pass
    p.wait()


def gpu_absent(env_result: dict[str, Any] | None) -> str | None:
    """Why the GPU steps cannot run here, or None when they can."""
    if env_result is None or "gpu" not in env_result:
        # the environment step gave no answer: where nvidia-smi is, the steps are tried
        if shutil.which("nvidia-smi") is None:
            return "no nvidia-smi on this machine (the environment step gave no answer)"
        return None
    return None if env_result["gpu"] else env_result.get("no_gpu_reason", "no GPU")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the folder for summary.json, logs, fixtures, tables")
    p.add_argument("--dry", action="store_true", help="skip every GPU step, even on a GPU")
    p.add_argument("--only", default="", help="comma-separated steps (install always runs)")
    a = p.parse_args()
    names = [s[0] for s in STEPS]
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    if only - set(names):
        print(f"check: unknown step(s) {', '.join(sorted(only - set(names)))}; "
              f"steps: {', '.join(names)}", file=sys.stderr)
        return 2
    try:
        boxes = boxes_from_env()
    except (SystemExit, ValueError) as e:
        print(f"check: {e}", file=sys.stderr)
        return 2
    out = Path(a.out).resolve()
    if out.exists() and not out.is_dir():
        print(f"check: {out} is not a folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    wheels = Path(os.environ.get("GPU_WHEELS", ROOT / "build" / "gpu-wheels")).resolve()
    target = Path(tempfile.mkdtemp(prefix="gputrace-gpu-check-"))
    ctx = {"root": str(ROOT), "out": str(out), "wheels": str(wheels),
           "target": str(target), "python": sys.executable, "dry": a.dry}
    (out / "context.json").write_text(json.dumps(ctx, indent=1))
    summary: dict[str, Any] = {
        "format": "gputrace-gpu-check", "version": 1, "python": sys.executable,
        "python_version": sys.version.split()[0], "wheels": str(wheels), "dry": a.dry,
        "started_unix_s": round(time.time(), 3), "steps": []}
    t_start = time.perf_counter()
    deadline = t_start + TOTAL_S
    chosen = [s for s in STEPS if s[0] == "install" or not only or s[0] in only]
    env_result: dict[str, Any] | None = None
    for i, (name, base, needs_gpu) in enumerate(chosen):
        step: dict[str, Any] = {"name": name, "needs_gpu": needs_gpu}
        summary["steps"].append(step)
        why = None
        if needs_gpu:
            why = "--dry" if a.dry else gpu_absent(env_result)
        if why:
            step.update(status="skipped", reason=why, wall_s=0.0)
            print(f"check: {name}: skipped ({why})", flush=True)
            write(out, summary, t_start)
            continue
        later = sum(boxes.get(n, b) for n, b, g in chosen[i + 1:]
                    if not (g and (a.dry or gpu_absent(env_result))))
        box = boxes.get(name, max(base, deadline - time.perf_counter() - later))
        step["box_s"] = round(box, 2)
        result = out / "logs" / f"{name}.result.json"
        result.unlink(missing_ok=True)
        env = dict(os.environ, GPU_CHECK_BOX_S=f"{box:.1f}", PYTHONUNBUFFERED="1")
        rc, wall = run_boxed([sys.executable, str(HERE / "steps.py"), name,
                              str(out / "context.json"), str(result)], box, env,
                             out / "logs" / f"{name}.log")
        step["wall_s"] = round(wall, 2)
        got: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
        if rc is None:
            step.update(status="failed", timed_out=True,
                        reason=f"over its time box of {box:.1f} s: killed")
            if got:
                step["partial"] = got
        elif rc != 0 or not got:
            step.update(status="failed", reason=f"exit code {rc}" + (
                "" if got else "; no result written") + f" (logs/{name}.log)")
            step.update({k: v for k, v in got.items() if k not in step})
        else:
            step.update(got)
        if name == "environment" and rc == 0:
            env_result = got.get("figures", {})
        print(f"check: {name}: {step['status']} in {wall:.1f} s"
              + (f" ({step['reason']})" if step.get("reason") else ""), flush=True)
        write(out, summary, t_start)
    shutil.rmtree(target, ignore_errors=True)
    write(out, summary, t_start)
    print(f"check: {out / 'summary.json'} in {time.perf_counter() - t_start:.1f} s")
    return 1 if any(s["status"] == "failed" for s in summary["steps"]) else 0


def write(out: Path, summary: dict[str, Any], t_start: float) -> None:
    summary["wall_s"] = round(time.perf_counter() - t_start, 2)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")


if __name__ == "__main__":
    sys.exit(main())
