"""The expert-parallel what-if (balanced routing) against the run it predicts: the
hand-written MoE of tests/jobs/moe_train.py on 2 ranks over gloo, recorded with its biased
router and with `--balanced`, in alternating rounds. The biased run's
`imbalance.groups[].balanced_saves_s` predicts the balanced run's iteration as its own
t_iter less the saving; measured: the balanced run's median iteration on the job's own
clock (iterations after warm-up).

    python bench/whatif_ep.py [--rounds 2] [--iterations 12] [--keep DIR] [--tiny]"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "moe_train.py"
WARMUP = 3


def record(prefix: Path, iterations: int, balanced: bool) -> tuple[dict, list[float]]:
    arrow = f"{prefix}.arrow"
    subprocess.run([sys.executable, "-m", "gputrace", "record", "-q", "-o", arrow, "--",
                    sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", str(JOB), str(prefix), "--iterations",
                    str(iterations)] + (["--balanced"] if balanced else []), check=True,
                   capture_output=True)
    doc = json.loads(subprocess.run([sys.executable, "-m", "gputrace", "analyze", arrow,
                                     "--json"], check=True, capture_output=True,
                                    text=True).stdout)
    own = []
    for r in (0, 1):
        t = json.loads(Path(f"{prefix}.rank{r}.json").read_text())
        own.append([(i["end"] - i["start"]) / 1e9 for i in t["iterations"][WARMUP:]])
    return doc, [float(np.median(np.max(own, axis=0)))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--keep", default=None)
    p.add_argument("--tiny", action="store_true", help="one round of 6 iterations")
    a = p.parse_args()
    if a.tiny:
        a.rounds, a.iterations = 1, 6
    out = Path(a.keep or tempfile.mkdtemp(prefix="whatif_ep_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    print("| round | biased t_iter (job) | tokens max/mean | saves | predicted | balanced "
          "t_iter (job) | error |")
    print("|---|---|---|---|---|---|---|")
    for k in range(a.rounds):
        doc, (biased,) = record(out / f"biased{k}", a.iterations, False)
        _, (balanced,) = record(out / f"balanced{k}", a.iterations, True)
        g = max(doc["ranks"]["0"]["parallelism"]["expert_parallel"]["imbalance"]["groups"],
                key=lambda g: g["balanced_saves_s"])
        pred = biased - g["balanced_saves_s"]
        print(f"| {k} | {biased * 1e3:.1f} ms | {g['tokens_ratio']:.2f}x | "
              f"{g['balanced_saves_s'] * 1e3:.1f} ms | {pred * 1e3:.1f} ms | "
              f"{balanced * 1e3:.1f} ms | {pred / balanced - 1:+.1%} |")


if __name__ == "__main__":
    main()
