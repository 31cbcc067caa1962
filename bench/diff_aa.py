"""A/A: the same short job recorded twice, `gputrace diff` of the pair, many pairs: how
often does the headline call the change within noise (it should, nothing changed)?

The job is tests/jobs/slowed_phase.py as it is (no slowing): a small CPU training loop whose
forward has a cost that varies from step to step. Each pair is recorded one run after the
other; `--hog` runs a busy process beside every recording (a CPU hog on the machine). The
target: within noise in at least 19 of 20 pairs. Per pair it prints the headline's change,
its interval and the verdict; at the end the count, and the loops' own change (their
perf_counter) beside the diff's, the change of the job's wait for a CPU per iteration and
each run's stalls per iteration (the between-run noise the interval holds).

    python bench/diff_aa.py [--pairs 20] [--steps 20] [--hog] [--keep DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, machine, run, table

JOB = ROOT / "tests" / "jobs" / "slowed_phase.py"
HOG = "import time\nwhile True:\n    time.perf_counter()\n"


def record(out: Path, name: str, steps: int) -> tuple[Path, list[dict[str, float]]]:
    trace, truth = out / f"{name}.arrow", out / f"{name}.json"
    run([PY, "-m", "gputrace", "record", "-q", "-f", "-o", str(trace), "--", PY, str(JOB),
         str(truth), "--steps", str(steps)], timeout=600)
    return trace, json.loads(truth.read_text())


def pair(out: Path, i: int, steps: int) -> dict[str, float | str | bool]:
    (ta, sa), (tb, sb) = record(out, f"a{i}", steps), record(out, f"b{i}", steps)
    _, p = run([PY, "-m", "gputrace", "diff", str(ta), str(tb), "--json"], timeout=600)
    doc = json.loads(p.stdout)
    h, n = doc["headline"], doc["iterations"]["after"]
    own = (sum(s["iteration"] for s in sb[-n:]) - sum(s["iteration"] for s in sa[-n:])) / n
    w = doc["noise"]["run_wait_s"]
    wait = w["after"] - w["before"] if None not in (w["before"], w["after"]) else None
    return {"before": h["before"], "change": h["change"], "low": h["low"], "high": h["high"],
            "verdict": h["verdict"], "own": own, "within": not h["beyond_noise"],
            "wait": wait, "stalls": doc["noise"]["excursions_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--steps", type=int, default=20, help="iterations of each run (20)")
    p.add_argument("--hog", action="store_true", help="a busy process beside each run")
    p.add_argument("--keep", metavar="DIR", help="keep the recordings there")
    p.add_argument("--tiny", action="store_true", help="2 pairs of 8 steps (a smoke run)")
    a = p.parse_args()
    if a.tiny:
        a.pairs, a.steps = 2, 8
    out = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="diff_aa-"))
    out.mkdir(parents=True, exist_ok=True)
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if a.hog else None
    rows, within = [], 0
    try:
        for i in range(a.pairs):
            r = pair(out, i, a.steps)
            within += bool(r["within"])
            rows.append([str(i), f"{r['before'] * 1e3:.1f}", f"{r['change'] * 1e3:+.2f}",
                         f"[{r['low'] * 1e3:+.2f}, {r['high'] * 1e3:+.2f}]", str(r["verdict"]),
                         f"{r['own'] * 1e3:+.2f}",
                         "-" if r["wait"] is None else f"{r['wait'] * 1e3:+.2f}",
                         "/".join(f"{(r['stalls'][k] or 0) * 1e3:.1f}"  # type: ignore[index]
                                  for k in ("before", "after"))])
            print(" ".join(rows[-1]), file=sys.stderr)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"machine: {machine()}")
    print(table(f"A/A pairs of tests/jobs/slowed_phase.py, {a.steps} steps each"
                f"{', beside a CPU hog' if a.hog else ''} (ms)",
                ["pair", "t_iter", "change", "95 % interval", "verdict", "job's own change",
                 "wait for a CPU, change", "stalls before/after"],
                rows))
    print(f"within noise: {within} of {a.pairs} pairs (target: 19 of 20)")


if __name__ == "__main__":
    main()
