"""What-if predictions checked against the runs they predict.

A matrix of real 2-rank gloo DDP runs on the CPU is recorded with gputrace: two models (one
with many small layers, one with a few large ones), DDP's bucket_cap_mb 1, 5, 25 and one
bucket, and the link as it is and throttled. Every run then predicts every other run of its
model with `analyze`'s replay (the what-if of `--what-if bucket_cap_mb=..,bandwidth=..x`),
and the prediction errors are printed as a table. A one-process run of each model predicts
its 2-rank run (the GPU-count what-if) from the link's measured all-reduce bandwidth.

The two ranks run in two network namespaces joined by a veth pair (needs root and
iproute2), so gloo's traffic crosses a link that can be throttled for real: a token-bucket
filter (tc) on both ends. The bandwidth what-if's factor is the ratio of the all-reduce bus
bandwidths measured on the link in its two states. Without namespaces (not root) the ranks
use the loopback and the throttled runs are left out.

    python bench/whatif.py [--iterations 30] [--models deep,wide] [--buckets 1,5,25,one]
                           [--throttle 2gbit] [--keep DIR] [--reuse DIR] [--tiny]

--keep keeps the traces (and a runs.json describing them) in DIR; --reuse DIR analyzes those
again without recording (to compare replay models on the same runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, machine, median, table

MIB = 1 << 20
MODELS = {
    # many small layers: 10 fully-connected layers of 0.56 MB, small convolutions
    "deep": ["--width", "8", "--fc-hidden", "384", "--fc-layers", "10", "--batch-size", "32",
             "--image-size", "32", "--workers", "1"],
    # a few large layers: 4 MB and 16.8 MB fully-connected layers near the output
    "wide": ["--preset", "case2", "--workers", "1"],
}

ALLREDUCE = r"""
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(int(sys.argv[1]) // 4)
for _ in range(3):
    dist.all_reduce(x)
ts = []
for _ in range(8):
    t = time.perf_counter(); dist.all_reduce(x); ts.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    ts.sort()
    n = dist.get_world_size()
    print(x.numel() * 4 / ts[len(ts) // 2] * 2 * (n - 1) / n)
dist.destroy_process_group()
"""


class Link:
    """Two network namespaces joined by a veth pair: rank r runs in namespace r."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}"
        self.ns = [f"gtw{tag}a", f"gtw{tag}b"]
        self.dev = [f"gtw{tag}x", f"gtw{tag}y"]
        self.addr = ["10.88.0.1", "10.88.0.2"]
        self.up = False

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def start(self) -> bool:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            return False
        try:
            for ns in self.ns:
                self._ip("netns", "add", ns)
            self.up = True
            self._ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"whatif: no network namespaces here ({e}); the ranks use the loopback",
                  file=sys.stderr)
            self.stop()
            return False
        return True

    def throttle(self, rate: str | None, burst: str = "256kb") -> None:
        """The link limited to `rate` by a token bucket of `burst` bytes (None: as it is). A
        transfer shorter than the bucket passes at the link's own speed."""
        for ns, dev in zip(self.ns, self.dev, strict=True):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            if rate:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                                "root", "tbf", "rate", rate, "burst", burst, "latency",
                                "100ms"], check=True, capture_output=True)

    def stop(self) -> None:
        if self.up:
            for ns in self.ns:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.up = False

    def command(self, job: list[str], port: int) -> list[str]:
        """A shell that starts rank 0 and rank 1 of `job`, each in its namespace."""
        parts = []
        for r in (0, 1):
            env = (f"RANK={r} LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 "
                   f"MASTER_ADDR={self.addr[0]} MASTER_PORT={port} "
                   f"GLOO_SOCKET_IFNAME={self.dev[r]}")
            parts.append(f"ip netns exec {self.ns[r]} env {env} "
                         + " ".join(_quote(a) for a in job) + " & p" + str(r) + "=$!")
        return ["sh", "-c", "; ".join(parts) + "; wait $p0; a=$?; wait $p1; b=$?; "
                "[ $a -eq 0 ] && [ $b -eq 0 ]"]


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def loopback(job: list[str], port: int) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
            "--master_port", str(port), *job[1:]]


def bus_bandwidth(link: Link | None, port: int, work: Path, nbytes: int = 16 * MIB) -> float:
    """All-reduce bus bandwidth (bytes/s) of gloo between the two ranks, as nccl-tests."""
    script = work / "allreduce_probe.py"
    script.write_text(ALLREDUCE)
    job = [PY, str(script), str(nbytes)]
    cmd = link.command(job, port) if link else loopback(job, port)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"all-reduce probe failed:\n{p.stderr[-2000:]}")
    return float(p.stdout.split()[-1])


def record(out: Path, job: list[str], ranks: int, link: Link | None, port: int) -> None:
    cmd = job if ranks == 1 else (link.command(job, port) if link else loopback(job, port))
    p = subprocess.run([PY, "-m", "gputrace", "record", "-q", "-f", "-o", str(out), "--",
                        *cmd], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"recording {out.name} failed:\n{p.stderr[-3000:]}")


def bucket_bytes(b: str) -> float:
    return math.inf if b == "one" else float(b) * MIB


def bucket_arg(b: str) -> str:
    return "100000" if b == "one" else b


def predict(trace: Path, scenarios: list, link: float | None,  # type: ignore[type-arg]
            host: float | None) -> tuple[float, dict]:  # type: ignore[type-arg]
    """(measured t_iter, {scenario: predicted t_iter}) of one run, its link's all-reduce bus
    bandwidth and the host's own (gloo over the loopback) known, as `gputrace probe` gives
    them."""
    from gputrace import load
    from gputrace.analyzers import analyze

    a = analyze(load(trace), what_if=scenarios, link_bytes_per_s=link, host_bytes_per_s=host)
    ra = a.main
    out = {}
    if ra.replay is not None:
        for o in ra.replay.outcomes:
            out[o.scenario] = o.t_iter
    return ra.breakdown["t_iter"].mean, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--models", default="deep,wide")
    ap.add_argument("--buckets", default="1,5,25,one")
    ap.add_argument("--throttle", default="2gbit", help="tc rate of the throttled link ('' none)")
    ap.add_argument("--keep", help="keep the traces in this directory")
    ap.add_argument("--reuse", help="analyze the traces kept in this directory again")
    ap.add_argument("--tiny", action="store_true", help="two runs, one prediction each way")
    a = ap.parse_args()
    if a.tiny:
        a.iterations, a.models, a.buckets, a.throttle = 8, "deep", "1,one", ""
    from gputrace.analyzers.parallel.ddp.replay import Scenario

    models = a.models.split(",")
    buckets = a.buckets.split(",")
    work = Path(a.reuse or a.keep or tempfile.mkdtemp(prefix="gputrace-whatif-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    port = 29600 + os.getpid() % 300
    if a.reuse:
        runs = json.loads((work / "runs.json").read_text())
        if "host" not in runs:
            runs["host"] = bus_bandwidth(None, port, work)
            (work / "runs.json").write_text(json.dumps(runs, indent=1))
    else:
        link = Link()
        namespaces = link.start()
        runs = {"links": {}, "runs": [], "namespaces": namespaces,
                # the host's own gloo all-reduce (loopback): the least CPU a byte costs
                "host": bus_bandwidth(None, port - 1, work)}
        try:
            links = {"as is": None}
            if namespaces and a.throttle:
                links["throttled"] = a.throttle
            for name, rate in links.items():
                if namespaces:
                    link.throttle(rate)
                port += 1
                runs["links"][name] = bus_bandwidth(link if namespaces else None, port, work)
                for m in models:
                    for b in buckets:
                        out = work / f"{m}-{b}-{name.replace(' ', '_')}.arrow"
                        job = [PY, "samples/train_cnn.py", *MODELS[m], "--bucket-cap-mb",
                               bucket_arg(b), "--iterations", str(a.iterations),
                               "--data", str(data)]
                        port += 1
                        record(out, job, 2, link if namespaces else None, port)
                        runs["runs"].append({"model": m, "bucket": b, "link": name,
                                             "ranks": 2, "trace": out.name})
                        print(f"recorded {out.name}", file=sys.stderr)
            if not a.tiny:
                for m in models:    # one process, for the 1 -> 2 rank prediction
                    out = work / f"{m}-one_process.arrow"
                    record(out, [PY, "samples/train_cnn.py", *MODELS[m], "--iterations",
                                 str(a.iterations), "--data", str(data)], 1, None, 0)
                    runs["runs"].append({"model": m, "bucket": "25", "link": "as is",
                                         "ranks": 1, "trace": out.name})
        finally:
            if namespaces:
                link.throttle(None)
            link.stop()
        (work / "runs.json").write_text(json.dumps(runs, indent=1))

    print(f"machine: {machine()}")
    bw = runs["links"]
    print(f"host (loopback): {runs['host'] / 1e6:.0f} MB/s; links: "
          + ", ".join(f"{k} {v / 1e6:.0f} MB/s all-reduce bus bandwidth" for k, v in bw.items())
          + ("" if runs["namespaces"] else " (loopback: no network namespaces here)"))
    two = [r for r in runs["runs"] if r["ranks"] == 2]
    measured = {}
    rows, errors = [], {"bucket": [], "bandwidth": [], "both": [], "gpus": []}
    for src in two:
        others = [t for t in two if t["model"] == src["model"] and t is not src]
        scen = {}
        for t in others:
            x = bw[t["link"]] / bw[src["link"]]
            b = None if t["bucket"] == src["bucket"] else bucket_bytes(t["bucket"])
            scen[t["trace"]] = Scenario(0, x, b)
        t_src, pred = predict(work / src["trace"], list(scen.values()), bw[src["link"]],
                              runs.get("host"))
        measured[src["trace"]] = t_src
        src["pred"] = {k: pred.get(Scenario(2, s.bandwidth_x, s.bucket_bytes))
                       for k, s in scen.items()}
    for src in two:
        for t in two:
            if t["model"] != src["model"] or t is src:
                continue
            p = src["pred"].get(t["trace"])
            truth = measured[t["trace"]]
            err = (p - truth) / truth if p is not None else float("nan")
            kind = ("bucket" if t["link"] == src["link"] else "bandwidth"
                    if t["bucket"] == src["bucket"] else "both")
            errors[kind].append(err)
            rows.append([src["model"], f"{src['bucket']} / {src['link']}",
                         f"{t['bucket']} / {t['link']}", f"{measured[src['trace']] * 1e3:.1f}",
                         f"{p * 1e3:.1f}" if p is not None else "-", f"{truth * 1e3:.1f}",
                         f"{err:+.1%}" if p is not None else "-"])
    for one in (r for r in runs["runs"] if r["ranks"] == 1):
        from gputrace import load
        from gputrace.analyzers import analyze

        target = next((t for t in two if t["model"] == one["model"] and t["bucket"] == "25"
                       and t["link"] == "as is"), None)
        if target is None:
            continue
        ra = analyze(load(work / one["trace"]), link_bytes_per_s=bw["as is"],
                     what_if=[Scenario(2, 1.0, 25 * MIB)]).main
        p = next((o.t_iter for o in ra.replay.outcomes if o.scenario ==
                  Scenario(2, 1.0, 25 * MIB)), None) if ra.replay else None
        truth = measured[target["trace"]]
        err = (p - truth) / truth if p is not None else float("nan")
        errors["gpus"].append(err)
        rows.append([one["model"], "1 process", "25 / as is, 2 ranks",
                     f"{ra.breakdown['t_iter'].mean * 1e3:.1f}",
                     f"{p * 1e3:.1f}" if p else "-", f"{truth * 1e3:.1f}",
                     f"{err:+.1%}" if p else "-"])
    print(table("What-if predictions vs the runs they predict (t_iter, ms; bucket_cap_mb / "
                "link)", ["model", "from run", "predicts run", "its t_iter", "predicted",
                          "measured", "error"], rows))
    for kind, errs in errors.items():
        e = [abs(x) for x in errs if not math.isnan(x)]
        if e:
            print(f"{kind:>9} predictions: {len(e)}, median |error| {median(e):.1%}, "
                  f"worst {max(e):.1%}, within 10 %: {sum(x <= 0.10 for x in e)}")
    if a.keep or a.reuse:
        print(f"traces in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
