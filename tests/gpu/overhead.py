"""The GPU check's overhead step: three CUDA jobs plain and under `gputrace record
--gpu-timeline cupti`, in interleaved rounds (each round runs every job in both modes, in a
shuffled order), the ratio of median iterations with its 95 % interval from resampling
rounds (bench/common.py's ratio_ci, as bench/overhead_gpt.py gives it).

    python tests/gpu/overhead.py DIR [--rounds 5] [--min-rounds 2] [--device cuda] [--tiny]

Jobs: the CUDA loop (tests/jobs/cuda_loop.py), the GPT-2-shaped transformer with 12 blocks
(tests/gpu/gpt_cuda.py, bench/train_gpt.py's model) and a launch-bound loop of at least
20k kernel launches per second (tests/gpu/launch_loop.py; the job's own count of the ops it
issued over its own clock). Rounds run while another fits in the step's box
(GPU_CHECK_BOX_S); DIR/overhead.json and DIR/overhead.txt are written after every round.
`--device cpu --tiny` tries the machinery without a GPU (the CUDA loop needs one: left out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import PY, machine, median, ratio_ci, run, table  # noqa: E402

SKIP = 3   # warm-up iterations left out of each run


def jobs(device: str, tiny: bool) -> dict[str, list[str]]:
    n = ["--steps", "8"] if tiny else ["--steps", "30"]
    out = {
        "cuda_loop": [str(ROOT / "tests" / "jobs" / "cuda_loop.py"), *n],
        "gpt2_12_blocks": [str(HERE / "gpt_cuda.py"), "--device", device, "--iterations",
                           "8" if tiny else "20",
                           *(["--width", "64", "--heads", "4", "--seq", "32", "--batch", "2",
                              "--vocab", "256"] if tiny else [])],
        "launch_bound": [str(HERE / "launch_loop.py"), "--device", device, *n,
                         *(["--launches", "100"] if tiny else [])],
    }
    if device != "cuda":
        del out["cuda_loop"]
    return out


def command(job: list[str], mode: str, out: Path, trace: Path) -> list[str]:
    cmd = [PY, job[0], str(out), *job[1:]]
    if mode == "plain":
        return cmd
    return [PY, "-m", "gputrace", "record", "-q", "-f", "--gpu-timeline", "cupti", "-o",
            str(trace), "--", *cmd]


def collector(trace: Path) -> Any:
    """The recorded run's GPU timeline status (that CUPTI ran, not the fallback)."""
    code = ("import json, sys\nfrom gputrace import load\ntr = load(sys.argv[1])\n"
            "rows = tr.table.to_pylist()\n"
            "print(json.dumps({'cupti': tr.metadata['collectors'].get('cupti'), "
            "'kernels': sum(r['cat'] == 'kernel' for r in rows)}))")
    try:
        _, p = run([PY, "-c", code, str(trace)], timeout=120)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (SystemExit, ValueError, IndexError) as e:
        return f"unreadable: {e}"[:300]


def summarize(runs: dict[str, dict[str, list[list[float]]]], extra: dict[str, Any]
              ) -> tuple[dict[str, Any], str]:
    res: dict[str, Any] = {}
    rows = []
    for job, by_mode in runs.items():
        plain, rec = by_mode["plain"], by_mode["cupti"]
        n = min(len(plain), len(rec))
        if n == 0:
            continue
        plain, rec = plain[:n], rec[:n]
        base = median([t for x in plain for t in x])
        mine = median([t for x in rec for t in x])
        lo, hi = ratio_ci(rec, plain)
        res[job] = {"rounds": n, "plain_ms": round(base * 1e3, 3),
                    "cupti_ms": round(mine * 1e3, 3), "ratio": round(mine / base, 4),
                    "ratio_95": [round(lo, 4), round(hi, 4)], **extra.get(job, {})}
        rows.append([job, str(n), f"{base * 1e3:.2f} ms", f"{mine * 1e3:.2f} ms",
                     f"{mine / base:.3f}x [{lo:.3f}, {hi:.3f}]"])
    text = table("Recording overhead on the GPU: median iteration after warm-up (the job's "
                 "own clock), plain vs `gputrace record --gpu-timeline cupti`",
                 ["job", "rounds", "plain", "recorded", "ratio [95 %]"], rows) if rows \
        else "no round finished"
    return res, text + f"\nmachine: {machine()}\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    box = float(os.environ.get("GPU_CHECK_BOX_S", "0")) or float("inf")
    t0 = time.perf_counter()
    todo = jobs(a.device, a.tiny)
    runs: dict[str, dict[str, list[list[float]]]] = {
        j: {"plain": [], "cupti": []} for j in todo}
    extra: dict[str, dict[str, Any]] = {j: {} for j in todo}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            t_round = time.perf_counter()
            for job, args in todo.items():
                if job in failed:
                    continue
                for mode in random.Random(f"{job}-{r}").sample(["plain", "cupti"], 2):
                    res, trace = Path(tmp) / f"{job}-{mode}.json", Path(tmp) / f"{job}.arrow"
                    try:
                        left = box - (time.perf_counter() - t0)
                        run(command(args, mode, res, trace),
                            timeout=max(left, 1) if left < 1800 else 1800)
                    except (SystemExit, Exception) as e:  # noqa: B036
                        failed[job] = f"round {r} {mode}: {e}"[-600:]
                        break
                    steps = json.loads(res.read_text())
                    times = [(s["end"] - s["start"]) / 1e9 for s in steps]
                    runs[job][mode].append(times[SKIP:] if len(times) > SKIP + 1 else times)
                    if "ops" in steps[0]:
                        rate = [s["ops"] / t for s, t in zip(steps, times, strict=True)][SKIP:]
                        extra[job].setdefault(f"{mode}_ops_per_s", []).append(
                            round(median(rate)))
                    if mode == "cupti" and r == 0:
                        extra[job]["recorded"] = collector(trace)
            figures, text = summarize(runs, extra)
            lb = figures.get("launch_bound", {})
            if lb.get("plain_ops_per_s"):
                lb["goal_launches_per_s_at_least"] = 20000
                lb["goal_met"] = median(lb["plain_ops_per_s"]) >= 20000
            doc = {"jobs": figures, "failed": failed, "device": a.device,
                   "wall_s": round(time.perf_counter() - t0, 1)}
            (out / "overhead.json").write_text(json.dumps(doc, indent=1))
            (out / "overhead.txt").write_text(text)
            took = time.perf_counter() - t_round
            left = box - (time.perf_counter() - t0)
            print(f"round {r}: {took:.1f} s, {left:.0f} s left", flush=True)
            if r + 1 >= a.min_rounds and left < 1.3 * took + 5:
                break
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
