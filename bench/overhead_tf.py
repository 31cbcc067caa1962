"""Recording overhead of the TensorFlow path: samples/train_tf.py (Keras fit) plain and under
`gputrace record`, side by side.

Modes: `plain`; `gputrace` (record with its defaults: the fit callback, TensorFlow's
profiler over steps 5-14); `hooks only` (the callback and hooks, no profiler, no system
sampler: `--collectors tensorflow --tf-steps off`); `profile all` (the profiler over every
step: `--tf-steps all`). Each round runs every mode once in a shuffled order; each run
reports its step times (fit's batch begin to the next one's, the sample's own callback), and
the table gives the median step after warm-up (the first 3) and the ratio to plain, with a
95 % interval from resampling rounds. `gputrace` is also shown over the profiled steps only
and over the others, since the profiler's cost falls on the steps it holds.

    python bench/overhead_tf.py [--steps 40] [--rounds 3] [--modes ...] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from common import PY, chosen_modes, machine, median, ratio_ci, run, table

MODES = ("plain", "gputrace", "hooks only", "profile all")
WINDOW = range(5, 15)        # the default --tf-steps 5:10


def command(mode: str, steps: int, times: Path, trace: Path) -> list[str]:
    job = [PY, "samples/train_tf.py", "--steps", str(steps), "--times-json", str(times)]
    opts = {"plain": None, "gputrace": [], "hooks only": ["--collectors", "tensorflow",
                                                          "--tf-steps", "off"],
            "profile all": ["--tf-steps", "all"]}[mode]
    if opts is None:
        return job
    return [PY, "-m", "gputrace", "record", "-q", "-f", *opts, "-o", str(trace), "--", *job]


def step_times(path: Path) -> list[float]:
    begins = json.loads(path.read_text())["begin_ns"]
    return [(b - a) / 1e9 for a, b in zip(begins, begins[1:], strict=False)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"modes to run (plain always runs): {', '.join(MODES)}")
    p.add_argument("--tiny", action="store_true", help="one quick round (keeps it working)")
    a = p.parse_args()
    modes = chosen_modes(p, a.modes, MODES)
    if a.tiny:
        a.steps, a.rounds, modes = 8, 1, ["plain", "gputrace"]
    runs: dict[str, list[list[float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for m in random.Random(r).sample(modes, len(modes)):
                times = Path(tmp) / f"{m}-{r}.json"
                run(command(m, a.steps, times, Path(tmp) / f"{r}.arrow"))
                runs[m].append(step_times(times))
    # step k's time is the gap between batch k's begin and batch k+1's: index k
    skip = 3
    after = {m: [run_[skip:] for run_ in rs] for m, rs in runs.items()}
    base = median([t for run_ in after["plain"] for t in run_])
    rows = []
    for m in modes:
        pooled = [t for run_ in after[m] for t in run_]
        ratio = "1.000x" if m == "plain" else \
            "{:.3f}x [{:.2f}, {:.2f}]".format(median(pooled) / base,
                                              *ratio_ci(after[m], after["plain"]))
        rows.append([m, str(len(runs[m])), f"{median(pooled) * 1e3:.1f} ms", ratio])
    if "gputrace" in modes and a.steps > WINDOW.stop:
        for label, keep in (("gputrace, steps 5-14 (profiled)", True),
                            ("gputrace, other steps", False)):
            sel = [[t for k, t in enumerate(run_) if (k in WINDOW) == keep and k >= skip]
                   for run_ in runs["gputrace"]]
            ref = [[t for k, t in enumerate(run_) if (k in WINDOW) == keep and k >= skip]
                   for run_ in runs["plain"]]
            pooled = [t for s in sel for t in s]
            rows.append([label, str(len(sel)), f"{median(pooled) * 1e3:.1f} ms",
                         "{:.3f}x [{:.2f}, {:.2f}]".format(
                             median(pooled) / median([t for s in ref for t in s]),
                             *ratio_ci(sel, ref))])
    print(table(f"TensorFlow recording overhead: median step of samples/train_tf.py (Keras "
                f"fit, CPU), {a.steps} steps a run, the first {skip} left out",
                ["mode", "rounds", "median step", "ratio to plain [95 %]"], rows))
    print("ratio [95 % interval]: bootstrap over rounds (the runs of a round as a pair); an "
          "interval that holds 1.0 is a difference the runs cannot tell from noise")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
