"""Recording overhead on a transformer: bench/train_gpt.py (GPT-2-shaped, 12 blocks, AdamW;
transformers' GPT2LMHeadModel when installed, see bench/requirements-gpt.txt) plain and under
`gputrace record`, one process and 2-rank gloo DDP.

Each round runs every mode once, in a shuffled order, so drift on a shared machine hits all
of them alike; the table gives the median iteration after warm-up (the loop's own clock) and
the ratio to plain with a 95 % interval from resampling rounds. Goal: <= 1.02x plain.

With --together a round's modes run at the same time on one core, each in its own session,
and their iterations are compared where all of them ran (see bench/common.py): the host's
drift, which moves sequential runs by 10-50 % here, then hits them alike. The recording
process (sampler and writer) runs on the other core (--record-core other: like a GPU node,
where it has a core the job does not use) or on the job's core too (same: every bit of
gputrace's CPU is taken from the job's share, the strictest figure).

    python bench/overhead_gpt.py [--rounds 12] [--iterations 20] [--ranks 1,2]
                                 [--modes gputrace,leaves,off,torch-only,hz20,forward,window,
                                          flops-off]
                                 [--job-args ARGS]
                                 [--together [--record-core other|same]] [--tiny]
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

JOB = str(Path(__file__).parent / "train_gpt.py")
# gputrace: the default (--layers blocks); leaves / off: the other granularities;
# torch-only: the default without the host sampler (--collectors torch); hz20: the sampler
# at 20 Hz; forward: the default with the blocks' forward spans (--layer-forward); window:
# the default with a window that never opens (--on-demand: every iteration outside it, its
# time and phase sums only); window-off: the same without per-layer spans; flops-off:
# the default without the FLOP count of iteration 2
# (--flops off; the median leaves the first 3 iterations out, so beside `gputrace` it shows
# what the count costs the other iterations)
MODES = ("plain", "gputrace", "leaves", "off", "torch-only", "hz20", "forward", "window",
         "window-off", "flops-off")


def command(mode: str, ranks: int, out: Path, trace: Path, job_args: list[str],
            core: int | None = None) -> list[str]:
    job = [JOB, str(out), *job_args]
    job = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           *job] if ranks > 1 else [PY, *job]
    if core is not None:   # --together: see detached() in bench/common.py
        job = detached(core, job)
    if mode == "plain":
        return job
    layers = {"gputrace": [], "torch-only": ["--collectors", "torch"],
              "forward": ["--layer-forward"],
              "hz20": ["--hz", "20"], "window": ["--on-demand"],
              "window-off": ["--on-demand", "--layers", "off"],
              "flops-off": ["--flops", "off"]}.get(mode, ["--layers", mode])
    return [PY, "-m", "gputrace", "record", "-q", *layers, "-o", str(trace), "--", *job]


def _p10(xs: list[float]) -> float:
    import numpy as np

    return float(np.percentile(xs, 10))


def _ratio(mine: list[list[float]], plain: list[list[float]]) -> float:
    return median([t for x in mine for t in x]) / max(median([t for x in plain for t in x]),
                                                       1e-12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--modes", default="gputrace", help=f"among {', '.join(MODES[1:])}")
    p.add_argument("--job-args", default="", help="more options for bench/train_gpt.py")
    together_args(p)
    p.add_argument("--tiny", action="store_true", help="one quick round (keeps it working)")
    a = p.parse_args()
    how = together_check(a)
    modes = chosen_modes(p, a.modes, MODES)
    extra = shlex.split(a.job_args)
    if a.tiny:
        a.rounds, a.iterations = 1, 200 if a.together else 6
        extra += ["--blocks", "2"]
    extra += ["--iterations", str(a.iterations)]
    rows = []
    costs = []   # (job, spans per iteration, plain iteration s, record's CPU per wall s)
    spans_per_iter = ""
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in [int(x) for x in a.ranks.split(",")]:
            runs: dict[str, list[list[float]]] = {m: [] for m in modes}
            sampler, spans = [0.0, 0.0], [0, 0]   # record's CPU and wall s; spans, iterations
            cpus: dict[str, list[list[float]]] = {m: [] for m in modes}   # loop thread's CPU
            pcpus: dict[str, list[list[float]]] = {m: [] for m in modes}  # the job process's
            for r in range(a.rounds):
                order = random.Random(f"{ranks}-{r}").sample(modes, len(modes))
                outs = {m: (Path(tmp) / f"{m}-{ranks}-{r}.json",
                            Path(tmp) / f"{m}-{ranks}-{r}.arrow") for m in order}
                if a.together:
                    got = round_together(
                        r, order, lambda m, core, n=ranks, o=outs: command(m, n, *o[m], extra, core),
                        {m: outs[m][0] for m in order}, modes[1:], a.record_core)
                for m in order:
                    out, trace = outs[m]
                    if not a.together:
                        run(command(m, ranks, out, trace, extra))
                    steps = json.loads(out.read_text())
                    times = [(s["end"] - s["start"]) / 1e9 for s in steps]
                    runs[m].append(got[m] if a.together
                                   else times[3:] if len(times) > 4 else times)
                    mc = [s.get("main_cpu", 0.0) for s in steps]
                    cpus[m].append(mc[3:] if len(mc) > 4 else mc)
                    pc = [s.get("cpu", 0.0) for s in steps]
                    pcpus[m].append(pc[3:] if len(pc) > 4 else pc)
                    if m == "gputrace":
                        tally(trace, sampler, spans)
                        if ranks == 1:
                            spans_per_iter = f"{spans[0] / max(spans[1], 1):.1f}"
                    print(f"ranks {ranks} round {r} {m}: {median(runs[m][-1]) * 1e3:.1f} ms",
                          flush=True)
            base = median([t for x in runs["plain"] for t in x])
            row = [f"{ranks} process{'es' if ranks > 1 else ''}", str(a.rounds),
                   f"{base * 1e3:.1f} ms"]
            for m in modes[1:]:
                mine = median([t for x in runs[m] for t in x])
                lo, hi = ratio_ci(runs[m], runs["plain"])
                per_round = [median(x) / median(y) for x, y in zip(runs[m], runs["plain"],
                                                                     strict=True)]
                p10 = _p10([t for x in runs[m] for t in x]) / _p10(
                    [t for x in runs["plain"] for t in x])
                lo10, hi10 = ratio_ci(runs[m], runs["plain"], q=10)
                lc, hc = ratio_ci(cpus[m], cpus["plain"])
                cpu_ratio = _ratio(cpus[m], cpus["plain"])
                lp, hp = ratio_ci(pcpus[m], pcpus["plain"])
                pcpu_ratio = _ratio(pcpus[m], pcpus["plain"])
                row += [f"{mine * 1e3:.1f} ms", f"{mine / base:.3f}x [{lo:.3f}, {hi:.3f}]",
                        f"{median(per_round):.3f}x", f"{p10:.3f}x [{lo10:.3f}, {hi10:.3f}]",
                        f"{cpu_ratio:.3f}x [{lc:.3f}, {hc:.3f}]",
                        f"{pcpu_ratio:.3f}x [{lp:.3f}, {hp:.3f}]"]
            rows.append(row)
            if "gputrace" in modes:
                costs.append((row[0], spans[0] / max(spans[1], 1), base,
                              sampler[0] / max(sampler[1], 1e-9)))
    print(table(f"Recording overhead: median iteration of bench/train_gpt.py "
                f"{' '.join(extra)}{how}", ["job", "rounds", "plain",
                                       *(h for m in modes[1:]
                                         for h in (m, "ratio [95 %]", "median of rounds",
                                                   "p10 ratio [95 %]", "loop CPU ratio",
                                                   "process CPU ratio"))],
                rows))
    print(f"spans per iteration recorded (1 process, default): {spans_per_iter}")
    print("ratio [95 % interval]: bootstrap over rounds (a round's runs kept as a pair); "
          "median of rounds: the median of the rounds' own ratios; p10 ratio: of the 10th "
          "percentile iterations (those the machine disturbed least); loop CPU ratio: of the "
          "CPU seconds of the loop's own thread per iteration (what gputrace adds on that "
          "thread; time the job waits for a core does not count); process CPU ratio: the "
          "same for all of the job process's threads (the loop, the writer thread folding "
          "what falls outside a window, torch's own), what it takes from its core")
    if costs:
        print()
        print(accounting(costs, a.tiny))
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
