"""A change of a job's own CPU demand, across repeated runs: tests/jobs/timed_loop.py (a
small CPU training loop timing itself, whose loader makes each sample with a short busy
wait) with `num_workers` 0 and 2, recorded 3 times each, interleaved (`gputrace record
--repeat 3 --interleave`: 0 2, 2 0, 0 2), and `gputrace diff` of the 3 against the 3, each
round. Per round: the diff's change of t_iter, its interval and verdict beside the loop's
own change (its perf_counter, over the iterations the diff analyzed), and the loop's own
paired interval (the same test on its own clock). The target: beyond noise in the
direction of the loop's own change, within 25 % of its size, wherever the loop's own
clock tells the change from its runs' drift.

    python bench/diff_loader.py [--rounds 3] [--steps 16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import PY, ROOT, machine, run, table

sys.path.insert(0, str(ROOT))
from gputrace.analyzers.compare.diff_runs import paired  # noqa: E402

JOB = ROOT / "tests" / "jobs" / "timed_loop.py"


def own_runs(path: Path, n: int) -> list[float]:
    """Each run's own mean iteration over its last `n` steps (the analyzed ones)."""
    return [float(np.mean([(s["end"] - s["start"]) / 1e9 for s in json.loads(ln)[-n:]]))
            for ln in path.read_text().splitlines()]


def one_round(out: Path, r: int, steps: int) -> list[str]:
    w0, w2 = out / f"r{r}-w0", out / f"r{r}-w2"
    for x in (w0, w2):
        Path(f"{x}.jsonl").unlink(missing_ok=True)
    job = [PY, str(JOB)]
    run([PY, "-m", "gputrace", "record", "-q", "-f", "--repeat", "3", "-o", f"{w0}.arrow",
         "--interleave", f"{w2}.arrow",
         "--", *job, f"{w0}.jsonl", "--loader", "--steps", str(steps), "--workers", "0",
         "--", *job, f"{w2}.jsonl", "--loader", "--steps", str(steps), "--workers", "2"],
        timeout=1800)
    _, p = run([PY, "-m", "gputrace", "diff", *(f"{w0}-{i}.arrow" for i in (1, 2, 3)), "--",
                *(f"{w2}-{i}.arrow" for i in (1, 2, 3)), "--json"], timeout=900)
    d = json.loads(p.stdout)
    h, n = d["headline"], d["iterations"]["before"] // 3
    a, b = own_runs(Path(f"{w0}.jsonl"), n), own_runs(Path(f"{w2}.jsonl"), n)
    want = float(np.mean(b) - np.mean(a))
    truth = paired(a, b)
    told = truth is not None and (truth.low > 0 or truth.high < 0)
    agrees = h["beyond_noise"] and (h["change"] > 0) == (want > 0) and \
        abs(h["change"] - want) <= 0.25 * abs(want)
    row = [str(r), f"{h['before'] * 1e3:.1f}", f"{h['after'] * 1e3:.1f}",
           f"{h['change'] * 1e3:+.2f}", f"[{h['low'] * 1e3:+.2f}, {h['high'] * 1e3:+.2f}]",
           h["verdict"], f"{want * 1e3:+.2f}",
           f"[{truth.low * 1e3:+.2f}, {truth.high * 1e3:+.2f}]" if truth else "-",
           "yes" if agrees else ("no" if told else "not told by its own clock")]
    print(" ".join(row), file=sys.stderr)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--keep", metavar="DIR", help="keep the recordings there")
    a = p.parse_args()
    out = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="diff_loader-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        rows = [one_round(out, r, a.steps) for r in range(a.rounds)]
    finally:
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"machine: {machine()}")
    print(table(f"num_workers 0 -> 2: tests/jobs/timed_loop.py --loader, {a.steps} steps, "
                "3 runs a side interleaved (ms)",
                ["round", "t_iter 0", "t_iter 2", "change", "95 % interval", "verdict",
                 "loop's own change", "loop's own interval", "beyond noise, its direction, "
                 "within 25 %"], rows))
    print(f"agreeing: {sum(r[-1] == 'yes' for r in rows)} of {len(rows)} rounds")


if __name__ == "__main__":
    main()
