"""A/A: the same short job recorded again and again, `gputrace diff` of the runs: how often
does it call a change beyond noise where nothing changed, and how large a change does it
find?

Repeated runs (the default): each round records the job 3 times as it is (A) and 3 times
with a busy wait of `--extra-ms` in one layer's backward (B), interleaved A B, B A, A B
(`gputrace record --repeat 3 --interleave`), and diffs the 3 against the 3 (A/B: is the
wait found, in t_iter and in its layer's row, and by how much beside the job's own clock).
Two rounds after another make two null comparisons of 3 runs against 3 of the same code,
interleaved in time (the A runs of both rounds taken alternately, and so the B runs): the
fraction of them called beyond noise in t_iter, and the share of every other row with an
interval (terms, layers, units, kinds, kernels, ranks) called beyond noise. The target: at
most 5 % at the stated 95 %, and a 5 % change found in 9 of 10. From the null
comparisons' standard errors it also estimates the smallest change found 9 times in 10
at 3, 10 and 20 runs a side ((t 0.975 + t 0.90) times the null pairs' pooled standard
deviation over the root of the pairs).

    python bench/diff_aa.py [--rounds 10] [--runs 3] [--steps 30] [--extra-ms 0.6] [--keep DIR]

One run against one (`--pairs N`): the job recorded twice, one after the other, N pairs;
how often the headline calls the change within noise:

The job is tests/jobs/slowed_phase.py as it is (no slowing): a small CPU training loop whose
forward has a cost that varies from step to step. Each pair is recorded one run after the
other; `--hog` runs a busy process beside every recording (a CPU hog on the machine). The
target: within noise in at least 19 of 20 pairs. Per pair it prints the headline's change,
its interval and the verdict; at the end the count, and the loops' own change (their
perf_counter) beside the diff's, the change of the job's wait for a CPU per iteration and
each run's stalls per iteration (the between-run noise the interval holds).

    python bench/diff_aa.py --pairs 20 [--steps 20] [--hog] [--keep DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from common import PY, ROOT, machine, run, table

JOB = ROOT / "tests" / "jobs" / "slowed_phase.py"
SLOWED = "2"    # the layer whose backward waits (model[2]), as the diff numbers it
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


def record_round(out: Path, r: int, steps: int, extra_ms: float, reuse: bool = False,
                 runs: int = 3) -> dict[str, Any]:
    """Round `r`: A and B, `runs` runs each, interleaved: side -> (traces, each run's steps);
    `reuse`: a round whose traces are there already (--keep) is diffed, not recorded again."""
    a, b = out / f"r{r}-a", out / f"r{r}-b"
    job = [PY, str(JOB)]
    have = [Path(f"{x}-{i}.arrow") for x in (a, b) for i in range(1, runs + 1)]
    if not (reuse and all(f.is_file() for f in have)):
        for x in (a, b):
            Path(f"{x}.jsonl").unlink(missing_ok=True)
        run([PY, "-m", "gputrace", "record", "-q", "-f", "--repeat", str(runs), "-o",
             f"{a}.arrow", "--interleave", f"{b}.arrow",
             "--", *job, f"{a}.jsonl", "--steps", str(steps),
             "--", *job, f"{b}.jsonl", "--steps", str(steps),
             "--backward-extra-ms", str(extra_ms)], timeout=1800)
    return {k: ([f"{x}-{i}.arrow" for i in range(1, runs + 1)],
                [json.loads(ln) for ln in Path(f"{x}.jsonl").read_text().splitlines()])
            for k, x in (("a", a), ("b", b))}


def diff_doc(before: list[str], after: list[str]) -> dict[str, Any]:
    _, p = run([PY, "-m", "gputrace", "diff", *before, "--", *after, "--json"], timeout=900)
    return json.loads(p.stdout)


def rows_called(doc: dict[str, Any]) -> tuple[int, int]:
    """Rows other than t_iter with an interval, and those called beyond noise."""
    rows = [v for k, v in doc["breakdown"].items() if k != "t_iter"]
    for tab in (doc["layers"]["forward"], doc["layers"]["backward"], doc["units"],
                doc["collectives"], doc["kernels"], doc["ranks"]):
        rows += tab["top"]
    rows = [r for r in rows if r.get("low") is not None]
    return len(rows), sum(bool(r["beyond_noise"]) for r in rows)


def own(steps: list[list[dict[str, float]]], key: str, n: int) -> float:
    return float(np.mean([np.mean([s[key] for s in run_[-n:]]) for run_ in steps]))


def t_pct(df: float, q: float) -> float:
    return float(np.percentile(np.random.default_rng(0).standard_t(df, 200_000), q))


def runs_needed(sd: float, change: float) -> int:
    """Runs a side (pairs, interleaved) at which `change` is found 9 times in 10 where the
    null pairs' differences have standard deviation `sd`: the smallest n with
    (t 0.975 + t 0.90, n - 1 df) sd / sqrt(n) <= change (halving between powers of 2)."""
    def found(n: int) -> bool:
        return (t_pct(n - 1, 97.5) + t_pct(n - 1, 90)) * sd / n ** 0.5 <= change

    hi = 2
    while not found(hi):
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if found(mid) else (mid, hi)
    return hi


def repeated(a: argparse.Namespace, out: Path) -> None:
    rounds = [record_round(out, r, a.steps, a.extra_ms, a.reuse, a.runs)
              for r in range(a.rounds)]
    ab, null, dfs = [], [], []
    for r, rd in enumerate(rounds):
        d = diff_doc(rd["a"][0], rd["b"][0])
        n = d["iterations"]["before"] // a.runs
        top = d["layers"]["backward"]["top"]    # the slowed layer: model[2], the 2nd Linear
        layer = next((x for x in top if x["name"].split()[0] == SLOWED),
                     max(top, key=lambda x: x["change"]))
        want = own(rd["b"][1], "iteration", n) - own(rd["a"][1], "iteration", n)
        ab.append([str(r), f"{d['headline']['before'] * 1e3:.1f}",
                   f"{d['headline']['change'] * 1e3:+.2f}",
                   f"[{d['headline']['low'] * 1e3:+.2f}, {d['headline']['high'] * 1e3:+.2f}]",
                   d["headline"]["verdict"], f"{want * 1e3:+.2f}",
                   f"{layer['name']} {layer['change'] * 1e3:+.2f}",
                   "found" if layer["beyond_noise"] and layer["change"] > 0 else "missed",
                   f"{own(rd['b'][1], 'extra', n) * 1e3:.2f}"])
        print(" ".join(ab[-1]), file=sys.stderr)
        if r % 2 == 1:      # rounds r-1 and r: each side's 6 runs, taken alternately
            for side in ("a", "b"):
                t = rounds[r - 1][side][0] + rd[side][0]
                d = diff_doc(t[0::2], t[1::2])
                h, (rows, beyond) = d["headline"], rows_called(d)
                se = [d["breakdown"]["t_iter"]["between_s"]] + [
                    x["between_s"] for x in d["layers"]["backward"]["top"] if x["between_s"]]
                dfs.append(a.runs - 1 if d["noise"]["paired"] else 2 * a.runs - 2)
                null.append([f"{r - 1}+{r} {side.upper()}", f"{h['before'] * 1e3:.1f}",
                             f"{h['change'] * 1e3:+.2f}",
                             f"[{h['low'] * 1e3:+.2f}, {h['high'] * 1e3:+.2f}]", h["verdict"],
                             f"{beyond}/{rows}", f"{se[0] * 1e3:.2f}",
                             f"{max(se[1:] or [0]) * 1e3:.3f}"])
                print(" ".join(null[-1]), file=sys.stderr)
    print(f"machine: {machine()}")
    print(table(f"A/B: tests/jobs/slowed_phase.py, {a.steps} steps, {a.runs} runs a side "
                f"interleaved, B with a {a.extra_ms:g} ms busy wait in one layer's backward "
                "(ms)", ["round", "t_iter", "change", "95 % interval", "verdict",
                         "job's own change", "top backward layer, change", "layer",
                         "job's own wait"], ab))
    found = sum(r[4] == "slower" for r in ab)
    layer_found = sum(r[7] == "found" for r in ab)
    print(f"t_iter found slower: {found} of {len(ab)}; the layer's row: {layer_found} of "
          f"{len(ab)}")
    if not null:
        return
    print(table(f"Null: {a.runs} runs against {a.runs} of the same code, interleaved (ms)",
                ["rounds", "t_iter", "change", "95 % interval", "verdict",
                 "rows beyond noise", "t_iter std. error", "largest layer std. error"],
                null))
    called = sum(r[4] != "within noise" for r in null)
    rows = [tuple(map(int, r[5].split("/"))) for r in null]
    print(f"t_iter beyond noise: {called} of {len(null)} null comparisons; rows beyond noise: "
          f"{sum(b for b, _ in rows)} of {sum(n for _, n in rows)} "
          f"({100 * sum(b for b, _ in rows) / max(sum(n for _, n in rows), 1):.1f} %)")
    # the spread of the null pairs' differences, pooled (each comparison's standard error
    # times the root of its pairs, squared, averaged): the smallest change found 9 times
    # in 10 at n pairs is (t 0.975 + t 0.90, n - 1 df) times it over the root of n
    df = max(set(dfs), key=dfs.count)   # n pairs: n - 1 degrees of freedom
    sd = float(np.sqrt(np.mean([a.runs * float(r[6]) ** 2 for r in null])))
    base = float(np.median([float(r[1]) for r in null]))
    at = ", ".join(f"{n} runs a side {(t_pct(n - 1, 97.5) + t_pct(n - 1, 90)) * sd / n ** 0.5:.2f}"
                   f" ms ({100 * (t_pct(n - 1, 97.5) + t_pct(n - 1, 90)) * sd / n ** 0.5 / base:.0f}"
                   " %)" for n in (3, 10, 20))
    print(f"smallest change found 9 times in 10, estimated from the null pairs' differences "
          f"(standard deviation {sd:.2f} ms, pooled; df {df} at {a.runs} pairs; iteration "
          f"{base:.1f} ms): {at}")
    print(f"a 5 % change ({0.05 * base:.2f} ms) found 9 times in 10 at "
          f"{runs_needed(sd, 0.05 * base)} runs a side, at this spread")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, help="one run against one, N pairs (the older "
                   "bench); without it, repeated runs")
    p.add_argument("--rounds", type=int, default=10, help="repeated runs: rounds of A B, B A, "
                   "A B (10); two rounds make two null comparisons")
    p.add_argument("--extra-ms", type=float, default=0.6,
                   help="repeated runs: B's busy wait in one layer's backward (0.6 ms: about "
                   "5 %% of the job's iteration on the bench machine)")
    p.add_argument("--runs", type=int, default=3, help="repeated runs: runs a side in a "
                   "round (3)")
    p.add_argument("--steps", type=int, help="iterations of each run (20; repeated: 30)")
    p.add_argument("--hog", action="store_true", help="a busy process beside each run")
    p.add_argument("--keep", metavar="DIR", help="keep the recordings there")
    p.add_argument("--reuse", action="store_true", help="repeated runs, with --keep: diff "
                   "the rounds already recorded there instead of recording them again")
    p.add_argument("--tiny", action="store_true", help="2 rounds (with --pairs: 2 pairs) of "
                   "8 steps (a smoke run)")
    a = p.parse_args()
    if a.tiny and a.pairs is None:
        a.rounds, a.steps = 2, 8
    elif a.tiny:
        a.pairs, a.steps = 2, 8
    out = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="diff_aa-"))
    out.mkdir(parents=True, exist_ok=True)
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if a.hog else None
    if a.pairs is None:
        a.steps = a.steps or 30
        try:
            repeated(a, out)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
            if not a.keep:
                shutil.rmtree(out, ignore_errors=True)
        return
    a.steps = a.steps or 20
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
