"""The expert-parallel what-if (balanced routing) against the run it predicts: the
hand-written MoE of tests/jobs/moe_train.py on 2 ranks over gloo, recorded with its biased
router and with `--balanced`, in alternating rounds. The biased run's
`imbalance.groups[].balanced_saves_s` predicts the balanced run's iteration as its own
t_iter less the saving; measured: the balanced run's median iteration on the job's own
clock (iterations after warm-up, the slower rank). Beside it, each run's terms as the job
timed them (medians over iterations, per rank): its compute outside the experts' forward
(the forward and backward less the experts' forward compute, the all-to-alls it stood in and
its wait for DDP: the dense layers and the experts' backward, the same work in both runs
over the two ranks, so the ratio of the ranks' means is the machine's speed between the two
recordings),
the experts' forward compute on each rank, the all-to-alls it stood in, its wait in them for
the other rank to enter (its entries on the host's clock), and the cores other processes
kept busy while it was recorded.

`--alternate`: one recording per round whose odd iterations are routed without the bias
(the job's `--alternate`); each biased iteration's t_iter less the what-if's saving for it
(`ep_whatif.saves_by_step`) predicts the mean of its two unbiased neighbours, a few hundred
ms apart at one machine speed; beside it, the error of predicting no change.

    python bench/whatif_ep.py [--rounds 2] [--iterations 12] [--keep DIR | --reuse DIR]
    [--tiny] [--alternate [--job titan]]

`--job titan`: the alternating recording of tests/jobs/titan_moe_train.py, the same MoE laid
out as torchtitan lays it out (functional all-to-alls under FSDP2)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "moe_train.py"
# the same MoE laid out as torchtitan lays it out (functional all-to-alls, FSDP2), `--alternate` only
JOBS = {"moe": JOB, "titan": ROOT / "tests" / "jobs" / "titan_moe_train.py"}
WARMUP = 3


def _busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _children_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def record(prefix: Path, iterations: int, balanced: bool) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    b, c, t = _busy_s(), _children_s(), time.monotonic()
    subprocess.run([sys.executable, "-m", "gputrace", "record", "-q", "-f", "-o",
                    f"{prefix}.arrow", "--", sys.executable, "-m", "torch.distributed.run",
                    "--standalone", "--nproc_per_node", "2", str(JOB), str(prefix),
                    "--iterations", str(iterations)] + (["--balanced"] if balanced else []),
                   check=True, capture_output=True, env=env, timeout=1200)
    others = max((_busy_s() - b) - (_children_s() - c), 0.0) / (time.monotonic() - t)
    Path(f"{prefix}.others").write_text(f"{others}\n")


def own(prefix: Path) -> dict[str, float]:
    """The run's terms on the job's own clock (ms), medians over iterations after warm-up."""
    t = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in (0, 1)]
    its = [x["iterations"][WARMUP:] for x in t]
    moe = [x["moe"][WARMUP:] for x in t]
    out = {"t_iter": float(np.median(np.max([[(i["end"] - i["start"]) / 1e6 for i in x]
                                             for x in its], axis=0)))}
    for r in (0, 1):
        me, other = moe[r], moe[1 - r]
        a2a = [sum(a["s"] for a in m["a2a"]) * 1e3 for m in me]
        wait = [sum(min(max(a["entry"], b["entry"]) - a["entry"], a["s"])
                    for a, b in zip(m["a2a"], o["a2a"], strict=True)) * 1e3
                for m, o in zip(me, other, strict=True)]
        dense = [(i["forward"] + i["backward"]) * 1e3 - m["expert_s"] * 1e3 - s
                 - m["grad_wait_s"] * 1e3 for i, m, s in zip(its[r], me, a2a, strict=True)]
        out[f"expert{r}"] = float(np.median([m["expert_s"] * 1e3 for m in me]))
        out[f"a2a{r}"] = float(np.median(a2a))
        out[f"wait{r}"] = float(np.median(wait))
        out[f"dense{r}"] = float(np.median(dense))
    out["dense"] = (out["dense0"] + out["dense1"]) / 2
    p = Path(f"{prefix}.others")
    out["others"] = float(p.read_text()) if p.exists() else float("nan")
    return out


def saves(prefix: Path) -> tuple[float, float]:
    doc = json.loads(subprocess.run([sys.executable, "-m", "gputrace", "analyze",
                                     f"{prefix}.arrow", "--json"], check=True,
                                    capture_output=True, text=True).stdout)
    g = max(doc["ranks"]["0"]["parallelism"]["expert_parallel"]["imbalance"]["groups"],
            key=lambda g: g["balanced_saves_s"])
    return g["balanced_saves_s"] * 1e3, g["tokens_ratio"]


def alternate(prefix: Path, iterations: int, record_it: bool, job: Path = JOB
              ) -> list[tuple[float, ...]]:
    """One recording whose odd iterations are routed without the bias: per biased
    iteration after warm-up with an unbiased one on either side, (its t_iter on the job's
    clock, the what-if's saving for it, the unbiased neighbours' mean t_iter), seconds."""
    from gputrace import load
    from gputrace.analyzers import analyze
    from gputrace.analyzers.parallel.ep import ep_whatif

    if record_it:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        subprocess.run([sys.executable, "-m", "gputrace", "record", "-q", "-f", "-o",
                        f"{prefix}.arrow", "--", sys.executable, "-m",
                        "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(job), str(prefix), "--iterations", str(iterations),
                        "--alternate"], check=True, capture_output=True, env=env,
                       timeout=1200)
    an = analyze(load(f"{prefix}.arrow"), detail=True)
    parts = {r: ra.dims["ep"] for r, ra in an.ranks.items()}
    by_step = ep_whatif.saves_by_step((0, 1), parts, {})
    truth = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in (0, 1)]
    its = {i["it"]: i for i in truth[0]["iterations"]}
    t_iter = {i: max((t["iterations"][k]["end"] - t["iterations"][k]["start"]) / 1e9
                     for t in truth) for k, i in enumerate(its)}
    unbiased = {m["it"]: m["balanced"] for m in truth[0]["moe"]}
    s = an.ranks[0].detail.series
    saves: dict[int, float] = {}
    for st, a, b in zip(s.step.tolist(), s.start_ns.tolist(), s.end_ns.tolist(),
                        strict=True):
        if st in by_step:
            ov = {i: min(b, t["end"]) - max(a, t["start"]) for i, t in its.items()}
            saves[max(ov, key=lambda i: ov[i])] = by_step[st]
    out = []
    for i, sv in sorted(saves.items()):
        if i < WARMUP or unbiased.get(i, True) or not (unbiased.get(i - 1) and
                                                        unbiased.get(i + 1)):
            continue
        out.append((t_iter[i], sv, (t_iter[i - 1] + t_iter[i + 1]) / 2))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--keep", default=None)
    p.add_argument("--reuse", default=None, help="the runs kept in DIR, not recorded again")
    p.add_argument("--tiny", action="store_true", help="one round of 6 iterations")
    p.add_argument("--alternate", action="store_true",
                   help="one recording whose odd iterations are unbiased: each biased one "
                        "predicts its unbiased neighbours, at one machine speed")
    p.add_argument("--job", choices=sorted(JOBS), default="moe",
                   help="with --alternate: the hand-written MoE (moe) or torchtitan's "
                        "layout (titan)")
    a = p.parse_args()
    if a.tiny:
        a.rounds, a.iterations = 1, 6
    out = Path(a.reuse or a.keep or tempfile.mkdtemp(prefix="whatif_ep_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    if a.alternate:
        print("| round | iteration pairs | biased t_iter (job) | saves | predicted | unbiased "
              "neighbours (job) | error (median) | error range | no change's error |")
        print("|---|---|---|---|---|---|---|---|---|")
        k = 0
        while (out / f"alt{k}.rank0.json").exists() if a.reuse else k < a.rounds:
            rows = np.array(alternate(out / f"alt{k}", a.iterations, not a.reuse,
                                      JOBS[a.job]))
            if rows.size:
                t, sv, u = rows.T
                err = (t - sv) / u - 1
                print(f"| {k} | {len(t)} | {np.median(t) * 1e3:.1f} ms | "
                      f"{np.median(sv) * 1e3:.1f} ms | {np.median(t - sv) * 1e3:.1f} ms | "
                      f"{np.median(u) * 1e3:.1f} ms | {np.median(err):+.1%} | "
                      f"{err.min():+.1%} .. {err.max():+.1%} | "
                      f"{np.median(t / u - 1):+.1%} |", flush=True)
            k += 1
        return
    print("| round | biased t_iter (job) | tokens max/mean | saves | predicted | balanced "
          "t_iter (job) | error | compute ratio | others (cores) |")
    print("|---|---|---|---|---|---|---|---|---|")
    terms = []
    k = 0
    while (out / f"biased{k}.rank0.json").exists() if a.reuse else k < a.rounds:
        if not a.reuse:
            record(out / f"biased{k}", a.iterations, False)
            record(out / f"balanced{k}", a.iterations, True)
        b, u = own(out / f"biased{k}"), own(out / f"balanced{k}")
        s, tok = saves(out / f"biased{k}")
        pred = b["t_iter"] - s
        print(f"| {k} | {b['t_iter']:.1f} ms | {tok:.2f}x | {s:.1f} ms | {pred:.1f} ms | "
              f"{u['t_iter']:.1f} ms | {pred / u['t_iter'] - 1:+.1%} | "
              f"{u['dense'] / b['dense']:.2f} | {b['others']:.2f} / {u['others']:.2f} |",
              flush=True)
        terms.append((k, b, u))
        k += 1
    print("\nthe job's own terms (ms per iteration, medians; rank 0 / rank 1):")
    print("| round | run | t_iter | compute outside the experts' forward | experts' forward | "
          "all-to-alls stood | "
          "waited in them |")
    print("|---|---|---|---|---|---|---|")
    for k, b, u in terms:
        for name, x in (("biased", b), ("balanced", u)):
            print(f"| {k} | {name} | {x['t_iter']:.1f} | {x['dense0']:.1f} / "
                  f"{x['dense1']:.1f} | {x['expert0']:.1f} / {x['expert1']:.1f} | "
                  f"{x['a2a0']:.1f} / {x['a2a1']:.1f} | {x['wait0']:.1f} / {x['wait1']:.1f} |")


if __name__ == "__main__":
    main()
