"""Shared helpers for the benchmarks: subprocess runs, medians, a table printer."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 1800
        ) -> tuple[float, subprocess.CompletedProcess[str]]:
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, **(env or {})))
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t, p


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio_ci(runs: list[list[float]], base: list[list[float]], n: int = 2000,
             seed: int = 0, q: float = 50) -> tuple[float, float]:
    """95 % bootstrap interval of median(runs) / median(base) (or of their `q`-th
    percentiles: q=10 compares the iterations a shared machine disturbed least, a steadier
    estimate of what recording itself costs). runs[i] and base[i] ran in the
    same round, side by side, so rounds are resampled as pairs: drift of the machine that
    both runs of a round saw cancels in the ratio. The run, not the iteration, is the unit
    (the iterations of one run share its machine state)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pick = rng.integers(0, len(runs), len(runs))
        out.append(np.percentile(np.concatenate([runs[i] for i in pick]), q)
                   / np.percentile(np.concatenate([base[i] for i in pick]), q))
    lo, hi = np.percentile(out, [2.5, 97.5])
    return float(lo), float(hi)


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    out = [title, line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def machine() -> str:
    import platform

    import psutil

    return (f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python {platform.python_version()}")


def chosen_modes(p: Any, asked: str, modes: Sequence[str]) -> list[str]:
    """The modes named in `asked` (comma-separated), "plain" first and always; an unknown
    one is the parser's error."""
    unknown = set(asked.split(",")) - set(modes)
    if unknown:
        p.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(modes)}")
    return ["plain", *(m for m in modes[1:] if m in asked.split(","))]


def accounting(costs: list[tuple[str, float, float, float]], tiny: bool) -> str:
    """gputrace's own work beside the job, counted rather than told from noisy wall times:
    spans recorded per iteration times what one costs the loop (bench/hookcost.py), and the
    recording process's CPU as a share of the machine's cores."""
    args = ["--iterations", "50", "--blocks", "3"] if tiny else []
    _, p = run([PY, str(Path(__file__).parent / "hookcost.py"), *args])
    per_span = max(json.loads(p.stdout)["us_per_span"] or 0.0, 0.0) * 1e-6
    cores = os.cpu_count() or 1
    rows = []
    for job, per_iter, base, rec_cpu in costs:
        hooks = per_iter * per_span / base
        rows.append([job, f"{per_iter:.1f}", f"{per_iter * per_span * 1e3:.2f} ms",
                     f"{100 * hooks:.2f}%", f"{100 * rec_cpu / cores:.2f}%",
                     f"{1 + hooks + rec_cpu / cores:.3f}x"])
    return (table(f"Cost accounting: {per_span * 1e6:.1f} us per recorded span "
                  f"(bench/hookcost.py), recording process over {cores} cores",
                  ["job", "spans/iter", "hooks/iter", "of plain iter", "record's share",
                   "bound"], rows)
            + "\nbound: the slowdown if every microsecond of gputrace's work delayed the job "
              "on a machine whose every core it keeps busy")


def tally(trace: Path, sampler: list[float], spans: list[int]) -> None:
    """Adds a recorded run to the totals: the recording process's CPU and wall seconds
    (`sampler`), the spans and iterations it recorded over all processes (`spans`)."""
    import gputrace

    tr = gputrace.load(trace)
    sampler[0] += tr.metadata["sampler"]["cpu_s"]
    sampler[1] += tr.metadata["sampler"]["wall_s"]
    kind = tr.table.column("kind").cast("string").to_numpy(False)
    cat = tr.table.column("cat").cast("string").to_numpy(False)
    spans[0] += int((kind == "span").sum())
    spans[1] += int((cat == "iteration").sum())


# -- runs side by side on one core -------------------------------------------------------
# Sequential rounds on a shared virtual machine move by 10-50 % between runs (the host's load
# on each virtual CPU changes over seconds), far more than the 2 % a recording overhead is
# allowed. Jobs that run at the same time on one core see the same host: each is given its
# own session, so the kernel's autogroup scheduling shares the core fairly between the jobs
# (not between their threads), and a job that needs more CPU per iteration runs its
# iterations that much slower. An A/A pair of plain runs stays within 1.5 % this way.

def autogroup() -> bool:
    """The kernel shares a core between sessions (not threads); without it a job with more
    threads would get more of the core."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def pinned(core: int, cmd: list[str]) -> list[str]:
    """cmd with its process tree held on one core."""
    return ["taskset", "-c", str(core), *cmd]


def detached(core: int, cmd: list[str]) -> list[str]:
    """cmd held on one core, in a session of its own. The job of `gputrace record` is run
    this way so that it and the recording process share no session: the kernel weighs a
    session's claim on each core by where its load is, and a recording process busy on
    another core would lower the job's share of its own (by about 3 % here)."""
    return ["setsid", "-w", *pinned(core, cmd)]


def together(cmds: list[tuple[list[str], int]], timeout: float = 1800,
             envs: list[dict[str, str]] | None = None) -> list[str]:
    """Runs the commands at once, each on its core (`taskset` inside a command may move
    its job elsewhere), in its own session and with its `envs` entry added to the
    environment, and waits for all; returns their stdouts. One that fails stops the
    benchmark with its stderr."""
    import tempfile

    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (cmd, core) in enumerate(cmds):
            out = open(Path(tmp) / f"{i}.out", "w+")   # noqa: SIM115 - closed below
            err = open(Path(tmp) / f"{i}.err", "w+")   # noqa: SIM115 - closed below
            procs.append((cmd, out, err, subprocess.Popen(
                pinned(core, cmd), cwd=ROOT, stdout=out, stderr=err, text=True,
                start_new_session=True, env=dict(os.environ, **(envs[i] if envs else {})))))
        deadline = time.monotonic() + timeout
        failed, stdouts = [], []
        for cmd, out, err, p in procs:
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            if rc != 0:
                err.seek(0)
                failed.append(f"{' '.join(cmd)} failed ({rc}):\n{err.read()[-3000:]}")
            out.seek(0)
            stdouts.append(out.read())
            out.close()
            err.close()
    if failed:
        raise SystemExit("\n".join(failed))
    return stdouts


def together_args(p: Any) -> None:
    """The options of a benchmark that can run its modes side by side."""
    p.add_argument("--together", action="store_true",
                   help="run a round's modes at the same time on one core")
    p.add_argument("--record-core", choices=("other", "same"), default="other",
                   help="with --together: where the recording process runs")


def together_check(a: Any) -> str:
    """Warns where the kernel would not share a core fairly; the title's words for how the
    runs were made."""
    if not a.together:
        return ""
    if not autogroup():
        print("warning: this kernel does not share a core by session (sched_autogroup off): "
              "a job with more threads gets more of it", flush=True)
    return (f", together on one core, the recording process on "
            f"{'the other' if a.record_core == 'other' else 'the same'} core")


def round_together(r: int, order: list[str], command_on: Any, steps: dict[str, Path],
                   recorded: Sequence[str], record_core: str) -> dict[str, list[float]]:
    """Round r of side-by-side runs: every mode's job (`command_on(mode, core)`) on one
    core, alternating between the cores from round to round; the recording process of the
    `recorded` modes on the other core or the same. Returns each mode's iteration seconds in
    the window all of them ran (read from its `steps` file)."""
    core = r % 2
    rec_core = 1 - core if record_core == "other" else core
    together([(command_on(m, core), rec_core if m in recorded else core) for m in order])
    return dict(zip(order, in_window([json.loads(steps[m].read_text()) for m in order]),
                    strict=True))


def in_window(runs: list[list[dict[str, Any]]], skip: int = 3) -> list[list[float]]:
    """Iteration seconds of jobs that ran together, only those inside the window where all
    of them were past their first `skip` iterations and none had finished yet: outside it a
    job had the core to itself."""
    lo = max(r[min(skip, len(r) - 1)]["start"] for r in runs)
    hi = min(r[-1]["end"] for r in runs)
    out = [[(s["end"] - s["start"]) / 1e9 for s in r if s["start"] >= lo and s["end"] <= hi]
           for r in runs]
    if not all(out):
        raise SystemExit("the jobs run together had no iteration in common past their warm-up:"
                         " give them more iterations")
    return out
