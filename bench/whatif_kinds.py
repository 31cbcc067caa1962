"""What-if kinds against the runs they predict, in one harness: for each kind, a base
configuration (A) and the configuration a what-if of it predicts (B) of a real 2-rank gloo
job, recorded in rounds, interleaved (A B, B A, A B, ...: what the machine does meanwhile
falls on both sides); each run of a side predicts the run of the other side in its round
(`analyze --json`'s what-if of that setting) where the analysis gives the what-if, and the
error, predicted / measured - 1, is printed per round beside the drift: how far each side's
own runs moved from round to round (max / min - 1 of its t_iter), the bound of any
prediction between runs. The measured side is gputrace's t_iter, checked against the job's
own clock (its perf_counter / time_ns around each iteration, over the analyzed ones).

Kinds:
  fsdp_forward_prefetch  tests/jobs/fsdp_train.py (FSDP2, 4 blocks): --forward-prefetch 0
                         <-> 1 (`sharded.what_if` 'forward prefetch 1' / '... 0')
  fsdp_backward_prefetch the same, FSDP2's default backward prefetch (one unit) <-> 2
                         (--backward-prefetch 2; 'backward prefetch 2' / '... 1')
  tp_degree              tests/jobs/tp_train.py: TP degree 2 on 2 ranks -> degree 1 (one
                         process); `parallelism.tensor_parallel.what_if` degree 1. On 2 CPU
                         ranks only 1 and 2 can be run, and a degree-1 run has no what-if of
                         degree 2 (the what-if needs TP's collectives measured)
  sharded_link           fsdp_train.py's 2 ranks in two network namespaces joined by a veth
                         pair (bench/whatif.py's Link; root): the link as it is <-> throttled
                         by `tc tbf` to half its all-reduce bus bandwidth, as measured
                         (`sharded.what_if` 'link x0.5' / 'link x2'; the ratio reached is
                         printed)

    python bench/whatif_kinds.py [--kinds fsdp_forward_prefetch,tp_degree] [--rounds 3]
        [--iterations 12] [--keep DIR [--reuse]]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import PY, ROOT, machine, run, table
from whatif import Link, bus_bandwidth

PORT = 29561
# the token bucket of the throttled link: smaller than FSDP's transfers of a unit (~0.26 MB a
# rank), which a bucket of 256 KB (bench/whatif.py's) let through at the link's own speed:
# its collectives took as long throttled as not
BURST = "64kb"

JOBS = ROOT / "tests" / "jobs"


def torchrun(ranks: int, job: str, *args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            str(JOBS / job), *args]


class Veth:
    """The two ranks over a veth pair (bench/whatif.py's Link), throttled for side B to
    half the as-is all-reduce bus bandwidth (one correction after a first try)."""

    def __init__(self, work: Path) -> None:
        self.link: Link | None = None
        self.work = work
        self.rate = ""
        self.ratio = float("nan")

    def start(self) -> None:
        if self.link is not None:
            return
        link = Link()
        if not link.start():
            raise SystemExit("sharded_link: no network namespaces here (needs root, ip and "
                             "tc): the link cannot be varied on this machine")
        self.link = link
        base = bus_bandwidth(link, PORT, self.work)
        bits = base * 8 * 0.5
        for _ in range(2):
            self.rate = f"{int(bits)}bit"
            link.throttle(self.rate, BURST)
            got = bus_bandwidth(link, PORT, self.work)
            link.throttle(None)
            self.ratio = got / base
            bits *= 0.5 / self.ratio
        print(f"sharded_link: as is {base / 1e6:.0f} MB/s bus bandwidth; tc tbf {self.rate}: "
              f"{self.ratio:.2f}x of it", flush=True)

    def stop(self) -> None:
        if self.link is not None:
            self.link.stop()

    def side(self, throttled: bool) -> Callable[[str, int], list[str]]:
        def cmd(out: str, it: int) -> list[str]:
            self.start()
            assert self.link is not None
            self.link.throttle(self.rate if throttled else None, BURST)
            return self.link.command([PY, str(JOBS / "fsdp_train.py"), out, "--mode", "fsdp2",
                                      "--iterations", str(it)], PORT)
        return cmd


@dataclass(frozen=True)
class Kind:
    """A: the base configuration, B: the one its what-if predicts (each a command given the
    job's OUT prefix); predict(doc, side): the prediction of the other side's t_iter from
    a side's `analyze --json` (None where the analysis gives none)."""

    name: str
    a: Callable[[str, int], list[str]]
    b: Callable[[str, int], list[str]]
    predict: Callable[[dict, str], float | None]
    setting: str


def _sharded(label: str) -> Callable[[dict], float | None]:
    def get(d: dict) -> float | None:
        w = next((x for x in (d.get("sharded") or {}).get("what_if", [])
                  if x["label"] == label), None)
        return None if w is None or w["withheld"] else w["t_iter"]
    return get


def _tp(degree: int) -> Callable[[dict], float | None]:
    def get(d: dict) -> float | None:
        tp = ((d.get("parallelism") or {}).get("tensor_parallel") or {})
        w = next((x for x in tp.get("what_if", []) if x["degree"] == degree), None)
        return None if w is None else w["t_iter"]
    return get


def _fsdp(prefetch: int, way: str = "forward") -> Callable[[str, int], list[str]]:
    return lambda out, it: torchrun(2, "fsdp_train.py", out, "--mode", "fsdp2", "--iterations",
                                    str(it), f"--{way}-prefetch", str(prefetch))


VETH = Veth(Path(tempfile.gettempdir()))
KINDS = {
    "fsdp_forward_prefetch": Kind(
        "FSDP2 forward prefetch", _fsdp(0), _fsdp(1),
        lambda d, side: (_sharded("forward prefetch 1") if side == "a"
                         else _sharded("forward prefetch 0"))(d),
        "forward prefetch 0 <-> 1 (set_modules_to_forward_prefetch), 4 blocks"),
    "fsdp_backward_prefetch": Kind(
        "FSDP2 backward prefetch", _fsdp(0, "backward"), _fsdp(2, "backward"),
        lambda d, side: (_sharded("backward prefetch 2") if side == "a"
                         else _sharded("backward prefetch 1"))(d),
        "backward prefetch FSDP2's default (1) <-> 2 (set_modules_to_backward_prefetch), "
        "4 blocks"),
    "tp_degree": Kind(
        "TP degree",
        lambda out, it: torchrun(2, "tp_train.py", out, "--iterations", str(it)),
        lambda out, it: torchrun(1, "tp_train.py", out, "--iterations", str(it)),
        lambda d, side: _tp(1)(d) if side == "a" else None,
        "degree 2 (2 ranks) -> 1 (one process), the same batch"),
    "sharded_link": Kind(
        "FSDP2 link bandwidth", VETH.side(False), VETH.side(True),
        lambda d, side: _sharded("link x0.5" if side == "a" else "link x2")(d),
        "a veth link as it is <-> throttled to half its bus bandwidth"),
}


def own_t_iter(out: str, d: dict) -> float:
    """Rank 0's own mean iteration (its clock) over the iterations gputrace analyzed."""
    its = json.loads(Path(f"{out}.rank0.json").read_text())["iterations"]
    skip = d["iterations"]["warmup_skipped"]
    return float(np.mean([(i["end"] - i["start"]) / 1e9 for i in its[skip:]]))


def one_run(kind: Kind, side: str, out: Path, it: int, reuse: bool) -> dict:
    trace = out.with_suffix(".arrow")
    if not reuse:
        cmd = (kind.a if side == "a" else kind.b)(str(out), it)
        run([PY, "-m", "gputrace", "record", "-q", "-f", "-o", str(trace), "--", *cmd],
            timeout=1200)
    _, p = run([PY, "-m", "gputrace", "analyze", str(trace), "--json"], timeout=600)
    d = json.loads(p.stdout)
    d = (d.get("ranks") or {}).get("0", d)   # rank 0's, as the job's clock
    return {"t_iter": d["breakdown"]["t_iter"]["mean"], "own": own_t_iter(str(out), d),
            "a": kind.predict(d, "a") if side == "a" else None,
            "b": kind.predict(d, "b") if side == "b" else None}


def bench(key: str, rounds: int, it: int, out: Path, reuse: bool) -> list[list[str]]:
    kind = KINDS[key]
    runs: list[dict[str, dict]] = []
    for r in range(rounds):
        pair = {}
        for side in ("ab" if r % 2 == 0 else "ba"):
            pair[side] = one_run(kind, side, out / f"{key}-r{r}-{side}", it, reuse)
        runs.append(pair)
    drift = {s: max(x[s]["t_iter"] for x in runs) / min(x[s]["t_iter"] for x in runs) - 1
             for s in "ab"}
    rows, errs = [], []
    for r, pair in enumerate(runs):
        for src, dst in (("a", "b"), ("b", "a")):
            pred = pair[src][src]
            if pred is None:
                continue
            meas = pair[dst]["t_iter"]
            errs.append(pred / meas - 1)
            rows.append([kind.name, str(r), f"{src.upper()} -> {dst.upper()}",
                         f"{pair[src]['t_iter'] * 1e3:.1f}", f"{pred * 1e3:.1f}",
                         f"{meas * 1e3:.1f} (own {pair[dst]['own'] * 1e3:.1f})",
                         f"{pred / meas - 1:+.1%}"])
    print(f"{kind.name}: {kind.setting}; drift (max / min - 1 of a side's t_iter over the "
          f"rounds): A {drift['a']:.1%}, B {drift['b']:.1%}", flush=True)
    if errs:
        print(f"  {len(errs)} predictions: error {min(errs):+.1%} .. {max(errs):+.1%}, median "
              f"{float(np.median(errs)):+.1%}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--reuse", action="store_true", help="analyze the runs kept in --keep")
    a = ap.parse_args()
    unknown = set(a.kinds.split(",")) - set(KINDS)
    if unknown or (a.reuse and a.keep is None):
        ap.error(f"unknown kind(s) {', '.join(sorted(unknown))}" if unknown
                 else "--reuse reads the runs of --keep DIR")
    out = a.keep or Path(tempfile.mkdtemp(prefix="whatif-kinds-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        print(machine(), flush=True)
        rows = [row for k in a.kinds.split(",")
                for row in bench(k, a.rounds, a.iterations, out, a.reuse)]
        print(table("What-if kinds against the runs they predict (rounds interleaved: A B, "
                    "B A, ...; rank 0's t_iter)",
                    ["kind", "round", "prediction", "from ms", "predicted ms",
                     "measured ms", "error"], rows))
    finally:
        VETH.stop()
        if a.keep is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
