"""Recording overhead: the CNN sample plain, under `gputrace record`, and under torch.profiler.

Each round runs every mode once, in a shuffled order, so drift on a shared machine hits all
of them alike and no mode always runs first; each run reports its per-iteration times, and the
table gives the median iteration after warm-up and the ratios to plain, with a 95 % interval
from resampling rounds. Goal: gputrace <= 1.02x plain.

    python bench/overhead.py [--iterations 40] [--rounds 3] [--ranks 1,2] [--sample-args ARGS]
                             [--modes plain,gputrace,...] [--save PATH]
                             [--together [--record-core other|same]] [--tiny]

With --together a round's modes run at the same time on one core, each in its own session,
and their iterations are compared where all of them ran (bench/common.py says why); one
torch thread per job unless --sample-args names --threads. The recording process runs on
the other core (--record-core other) or on the job's (same: the strictest figure).

With --save, every run's iteration times are kept in PATH as they come; run again with the
same PATH (and the same job) to add rounds to those already there.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import tempfile
from pathlib import Path

from common import (
    PY,
    accounting,
    chosen_modes,
    detached,
    machine,
    median,
    ratio_ci,
    round_together,
    run,
    table,
    tally,
    together_args,
    together_check,
)

# "hooks only": gputrace's in-process instrumentation without the system sampler, to tell
# the two costs apart
MODES = ("plain", "gputrace", "hooks only", "torch.profiler")


def command(mode: str, ranks: int, iterations: int, out: Path, trace: Path,
            extra: list[str], core: int | None = None) -> list[str]:
    job = ["samples/train_cnn.py", "--preset", "case1", "--iterations", str(iterations),
           "--steps-json" if core is not None else "--times-json", str(out), *extra]
    if ranks > 1:
        job = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(ranks), *job]
    else:
        job = [PY, *job]
    if mode == "torch.profiler":
        job.append("--torch-profiler")
    if core is not None:   # --together
        job = detached(core, job)
    if mode in ("gputrace", "hooks only"):
        only = ["--collectors", "torch"] if mode == "hooks only" else []
        return [PY, "-m", "gputrace", "record", "-q", *only, "-o", str(trace), "--", *job]
    return job


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--rounds", type=int, help="rounds to run (3; --tiny: 1)")
    p.add_argument("--ranks", default="1,2", help="process counts to run (1 and/or 2)")
    p.add_argument("--sample-args", default="",
                   help="more options for samples/train_cnn.py, e.g. '--threads 1 --workers 1'")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"modes to run (plain always runs): {', '.join(MODES)}")
    p.add_argument("--save", type=Path,
                   help="keep the runs in this JSON file, and add to the rounds it holds")
    together_args(p)
    p.add_argument("--tiny", action="store_true",
                   help="one quick round (keeps it working), a short hookcost")
    a = p.parse_args()
    how = together_check(a)
    modes = chosen_modes(p, a.modes, MODES)
    if a.tiny:
        a.iterations = 60 if a.together else 6
    if a.rounds is None:
        a.rounds = 1 if a.tiny else 3
    extra = shlex.split(a.sample_args)
    if a.together and "--threads" not in extra:
        extra += ["--threads", "1"]
    job = {"iterations": a.iterations, "sample_args": a.sample_args, "modes": modes,
           **({"together": a.record_core} if a.together else {})}
    saved = json.loads(a.save.read_text()) if a.save and a.save.exists() else {"job": job}
    if saved["job"] != job:
        p.error(f"{a.save} holds runs of another job ({saved['job']}); name another file")
    rows = []
    costs = []   # (job, spans per iteration, plain iteration s, record's CPU per wall s)
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in [int(x) for x in a.ranks.split(",")]:
            # "sampler": CPU and wall seconds of gputrace record's own process; "spans":
            # spans recorded and iterations, over all processes
            kept = saved.setdefault(str(ranks), {"runs": {m: [] for m in modes},
                                                 "sampler": [0.0, 0.0], "spans": [0, 0]})
            per_mode: dict[str, list[list[float]]] = kept["runs"]
            # --together: CPU seconds per iteration of the loop's thread and of the process
            cpus = {k: kept.setdefault(k, {m: [] for m in modes}) for k in ("main_cpu", "cpu")}
            sampler, spans = kept["sampler"], kept.setdefault("spans", [0, 0])
            first = len(per_mode["plain"])
            for r in range(first, first + a.rounds):
                order = random.Random(f"{ranks}-{r}").sample(modes, len(modes))
                outs = {m: (Path(tmp) / f"{m.replace(' ', '-')}-{ranks}-{r}.json",
                            Path(tmp) / f"{m.replace(' ', '-')}-{ranks}-{r}.arrow")
                        for m in order}
                if a.together:
                    got = round_together(
                        r, order,
                        lambda m, core, n=ranks, o=outs: command(m, n, a.iterations, *o[m], extra, core),
                        {m: outs[m][0] for m in order}, ("gputrace", "hooks only"),
                        a.record_core)
                for m in order:
                    out, trace = outs[m]
                    if a.together:
                        times = got[m]
                        steps = json.loads(out.read_text())[3:]
                        for k, v in cpus.items():
                            v[m].append([st[k] for st in steps])
                    else:
                        run(command(m, ranks, a.iterations, out, trace, extra))
                        times = json.loads(out.read_text())
                        times = times[3:] if len(times) > 4 else times
                    if m == "gputrace":
                        tally(trace, sampler, spans)
                    per_mode[m].append(times)
                if a.save:
                    a.save.write_text(json.dumps(saved))
            pooled = {m: [t for run in runs for t in run] for m, runs in per_mode.items()}
            base = median(pooled["plain"])
            row = [f"{ranks} process{'es' if ranks > 1 else ''}", str(len(per_mode["plain"])),
                   f"{base * 1e3:.1f} ms"]
            for m in modes[1:]:
                lo, hi = ratio_ci(per_mode[m], per_mode["plain"])
                row += [f"{median(pooled[m]) * 1e3:.1f} ms",
                        f"{median(pooled[m]) / base:.3f}x [{lo:.2f}, {hi:.2f}]"]
                if a.together:
                    for v in cpus.values():
                        lc, hc = ratio_ci(v[m], v["plain"])
                        mid = median([t for x in v[m] for t in x]) / max(
                            median([t for x in v["plain"] for t in x]), 1e-12)
                        row.append(f"{mid:.3f}x [{lc:.3f}, {hc:.3f}]")
            if "gputrace" in modes:
                row.append(f"{100 * sampler[0] / sampler[1]:.1f}% of a core")
                costs.append((row[0], spans[0] / max(spans[1], 1), base,
                              sampler[0] / sampler[1]))
            rows.append(row)
    print(table(f"Recording overhead: median iteration of samples/train_cnn.py --preset case1, "
                f"{' '.join(extra) + ', ' if extra else ''}"
                f"{a.iterations} iterations a run{how}",
                ["job", "rounds", "plain",
                 *(h for m in modes[1:] for h in (m, "ratio", *(
                     ("loop CPU ratio", "process CPU ratio") if a.together else ()))),
                 *(["record's CPU"] if "gputrace" in modes else [])], rows))
    print("ratio [95 % interval]: bootstrap over rounds (the runs of a round as a pair); an "
          "interval that holds 1.0 is a difference the runs cannot tell from noise")
    if a.together:
        print("CPU ratios: CPU seconds per iteration of the loop's thread, and of the whole job "
              "process (its other threads too), against plain's: what the job itself spent, "
              "whatever share of the core the scheduler gave it")
    if "gputrace" in modes:
        print("record's CPU: the recording process (sampler, writer, start-up) beside the job, "
              "CPU seconds over its wall time")
    if costs:
        print()
        print(accounting(costs, a.tiny))
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
