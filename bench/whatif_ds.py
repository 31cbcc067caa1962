"""DeepSpeed ZeRO's what-ifs checked against the runs they predict.

Real 2-rank DeepSpeed jobs over gloo on the CPU (tests/jobs/ds_train.py under torchrun:
an MLP of 5 layers, Adam), one configuration after the other in each round:
- `reduce_bucket_size` 5e8 (DeepSpeed's default: one bucket holds every gradient) and a
  quarter of the gradients' elements (the what-if the first run offers),
- `overlap_comm` on and off, and
- `allgather_bucket_size` 5e8 and a quarter of the gradients' elements,
at ZeRO stage 2 (and `--stages 1,2` for stage 1 too); at stage 3 (`--stages 3`):
- `stage3_prefetch_bucket_size` DeepSpeed's default (5e7: every parameter prefetched at the
  model's first fetch), a quarter of the gathered elements (a layer ahead) and 0 (none), and
- `stage3_max_live_parameters` DeepSpeed's default (1e9) and a quarter of the gathered
  elements (prefetch stops once a layer is live). Each run predicts every other run of
its stage that differs in one setting it offers a what-if for (`analyze --json`'s
`sharded.what_if`, matched by the setting's value), and the prediction is printed beside
the measured t_iter with the jobs' own per-iteration clock (the job times `engine(x)`, `engine.backward`,
`engine.step` itself).

    python bench/whatif_ds.py [--stages 2] [--rounds 2] [--iterations 30] [--width 512]
        [--keep DIR | --reuse DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, machine, table

JOB = ROOT / "tests" / "jobs" / "ds_train.py"
ONE_BUCKET = 500_000_000
SAME_SPEED = 0.10     # forward ratio beyond which a pair ran at two machine speeds
PREFETCH, LIVE = 50_000_000, 1_000_000_000   # DeepSpeed's stage 3 defaults


def grad_elements(width: int) -> int:
    return 4 * (width * width + width) + width * 10 + 10


# stage, reduce_bucket_size, overlap_comm, allgather, stage3 prefetch bucket, max live
Config = tuple[int, int, bool, int, int, int]


def configs(stages: list[int], width: int) -> list[Config]:
    """(stage, reduce_bucket_size, overlap_comm, allgather_bucket_size,
    stage3_prefetch_bucket_size, stage3_max_live_parameters) per configuration: stages 1-2,
    one bucket, a quarter of the gradients, overlap_comm on, and allgather_bucket_size (the
    step's all-gathers) at a quarter of the gradients; stage 3, the prefetch bucket at
    DeepSpeed's default, a quarter of the gathered elements (4 layers of width^2) and 0, and
    max_live at a quarter."""
    quarter = grad_elements(width) // 4
    layer = width * width
    out: list[Config] = []
    for s in stages:
        if s == 3:
            out += [(3, ONE_BUCKET, False, ONE_BUCKET, PREFETCH, LIVE),
                    (3, ONE_BUCKET, False, ONE_BUCKET, layer, LIVE),
                    (3, ONE_BUCKET, False, ONE_BUCKET, 0, LIVE),
                    (3, ONE_BUCKET, False, ONE_BUCKET, PREFETCH, layer)]
        else:
            out += [(s, ONE_BUCKET, False, ONE_BUCKET, PREFETCH, LIVE),
                    (s, quarter, False, ONE_BUCKET, PREFETCH, LIVE),
                    (s, ONE_BUCKET, True, ONE_BUCKET, PREFETCH, LIVE),
                    (s, ONE_BUCKET, False, quarter, PREFETCH, LIVE)]
    return out


SETTINGS = ("stage", "reduce_bucket_size", "overlap_comm", "allgather_bucket_size",
            "stage3_prefetch_bucket_size", "stage3_max_live_parameters")


def name(c: Config) -> str:
    return (f"zero{c[0]}-b{c[1]}-{'overlap' if c[2] else 'sync'}" +
            (f"-ag{c[3]}" if c[3] != ONE_BUCKET else "") +
            (f"-pf{c[4]}" if c[4] != PREFETCH else "") +
            (f"-live{c[5]}" if c[5] != LIVE else ""))


def record(out: Path, c: Config, a: argparse.Namespace) -> Path:
    trace = out / f"{name(c)}.arrow"
    cmd = [PY, "-m", "gputrace", "record", "-q", "-f", "-o", str(trace), "--", PY, "-m",
           "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB),
           str(out / name(c)), "--stage", str(c[0]), "--bucket", str(c[1]),
           "--iterations", str(a.iterations), "--width", str(a.width),
           "--allgather-bucket", str(c[3])] + (
        ["--overlap-comm"] if c[2] else []) + (
        ["--prefetch-bucket", str(c[4]), "--max-live", str(c[5])] if c[0] == 3 else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), DS_ACCELERATOR="cpu")
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200, env=env)
    return trace


def analyzed(trace: Path) -> dict:
    p = subprocess.run([PY, "-m", "gputrace", "analyze", "--json", str(trace)],
                       capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads(p.stdout)


def own_t_iter(out: Path, c: Config, skip: int = 3, phase: str | None = None) -> float:
    """The job's own mean iteration (rank 0's clock: forward + backward + step + the
    rest), or of one of its phases, warm-up left out."""
    steps = json.loads((out / f"{name(c)}.rank0.json").read_text())["iterations"][skip:]
    if phase:
        return statistics.fmean(s[phase] for s in steps)
    return statistics.fmean((s["end"] - s["start"]) / 1e9 for s in steps)


def offers(d: dict, src: Config, dst: Config) -> dict | None:
    """The what-if of `src`'s analysis that predicts `dst` (one setting changed)."""
    diff = [k for k, x, y in zip(SETTINGS, src, dst, strict=True) if x != y]
    if len(diff) != 1 or diff[0] == "stage":
        return None
    want = {diff[0]: dst[SETTINGS.index(diff[0])]}
    for w in (d.get("sharded") or {}).get("what_if", []):
        if all(w.get(k) == v for k, v in want.items()):
            return w
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--keep", type=Path, help="keep the traces in DIR")
    ap.add_argument("--reuse", type=Path, help="analyze the traces kept in DIR again")
    ap.add_argument("--tiny", action="store_true", help="stage 2, one bucket and a quarter "
                    "of the gradients, one round, 6 iterations")
    a = ap.parse_args()
    if a.tiny:
        # width 512 still: a cost per byte is fitted only on reductions of 1 MB or more
        a.stages, a.rounds, a.iterations, a.width = "2", 1, 6, 512
    cfgs = configs([int(s) for s in a.stages.split(",")], a.width)
    if a.tiny:
        cfgs = cfgs[:2]
    out = a.reuse or a.keep or Path(tempfile.mkdtemp(prefix="whatif-ds-"))
    rows, errors, moved, fwd_rows = [], [], [], []
    by_pair: dict[tuple[str, str], list[tuple[float, bool]]] = {}
    for i in range(a.rounds):
        sub = out / f"round{i}"
        sub.mkdir(parents=True, exist_ok=True)
        order = cfgs if i % 2 == 0 else cfgs[::-1]
        traces = {c: (sub / f"{name(c)}.arrow") if a.reuse else record(sub, c, a)
                  for c in order}
        res = {c: analyzed(t) for c, t in traces.items()}
        for src in cfgs:
            for dst in cfgs:
                w = offers(res[src], src, dst)
                if w is None:
                    continue
                meas = res[dst]["breakdown"]["t_iter"]["mean"]
                own = own_t_iter(sub, dst)
                if w.get("withheld"):
                    rows.append([str(i), name(src), w["label"], "withheld", "", "", "", "", ""])
                    continue
                err = w["t_iter"] / meas - 1
                # neither setting changes the forward (stage 3's, the backward: its prefetch
                # waits are the forward's): a pair whose forward differs ran at two machine
                # speeds, and its error measures the machine
                term = "t_b" if src[0] == 3 else "t_f"
                fwd = res[dst]["breakdown"][term]["mean"] / res[src]["breakdown"][term]["mean"]
                same = abs(fwd - 1) <= SAME_SPEED
                (errors if same else moved).append(err)
                by_pair.setdefault((name(src), w["label"]), []).append((err, same))
                if src[0] == 3:   # prefetch moves the forward's waits: the job's forward
                    own_f = own_t_iter(sub, dst, phase="forward") - \
                        own_t_iter(sub, src, phase="forward")
                    pred = w["t_iter"] - res[src]["breakdown"]["t_iter"]["mean"]
                    fwd_rows.append([str(i), name(src), w["label"], f"{pred * 1e3:+.1f}",
                                     f"{own_f * 1e3:+.1f}", f"{(pred - own_f) * 1e3:+.1f}"])
                rows.append([str(i), name(src), w["label"],
                             f"{res[src]['breakdown']['t_iter']['mean'] * 1e3:.1f}",
                             f"{w['t_iter'] * 1e3:.1f}", f"{meas * 1e3:.1f}",
                             f"{own * 1e3:.1f}", f"{err:+.1%}",
                             f"{fwd:.2f}" + ("" if same else " (speed changed)")])
    print(f"machine: {machine()}")
    print(f"ds_train.py: width {a.width}, {a.iterations} iterations, 2 ranks (gloo); "
          f"stage(s) {a.stages}; t_iter: rank 0's mean over the analyzed iterations")
    print(table("DeepSpeed what-if against the run it predicts",
                ["round", "from", "what-if", "from t_iter ms", "predicted ms", "measured ms",
                 "job's own ms", "error", "speed ratio (t_f; stage 3: t_b)"], rows) if rows else
          "no run offered a what-if for another")
    if fwd_rows:
        print(table("ZeRO-3 prefetch: the predicted change of the iteration against the "
                    "change of the job's own forward (perf_counter around engine(x))",
                    ["round", "from", "what-if", "predicted change ms",
                     "job's forward change ms", "difference ms"], fwd_rows))
    for what, errs in (("at one machine speed", errors), ("the others", moved)):
        if errs:
            print(f"predictions {what}: {len(errs)}, |error| at most "
                  f"{max(abs(e) for e in errs):.1%}, median "
                  f"{statistics.median(abs(e) for e in errs):.1%}")
    means = {k: statistics.fmean(e for e, ok in v if ok) for k, v in by_pair.items()
             if any(ok for _, ok in v)}
    if means:
        print("per prediction, its mean error over the rounds at one machine speed: " +
              ", ".join(f"{s} -> {w}: {m:+.1%}" for (s, w), m in means.items()))
    if not (a.keep or a.reuse):
        import shutil

        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
