"""Analysis of many ranks: wall time and peak memory of `gputrace analyze` as the rank count
grows, in one process, in worker processes and on a local Dask cluster; and the merge at the
end of a recording, whose memory should not grow with the rank count.

Each size is a synthetic multi-node recording (bench/synth.py: 8 ranks per node, one file
per node, as `record` writes them on each node of a run): the same events per rank, so the
top size holds `--events` in all. Peak memory is the sum over the processes that do the
work (the command and its workers; on Dask, the client and the cluster's workers), sampled
every 20 ms; CPU is their user + system seconds (on a shared machine, wall time over CPU
time shows how much of the cores the run got). Goals on a 2-core machine: 1e8 events in <= 60 s and <= 2 GB with 2 jobs; the
merge's peak flat in the rank count.

    python bench/scale.py [--ranks 256,1024] [--events 1e8] [--merge-events-per-rank 2e4]
                          [--keep DIR] [--tiny]
    python bench/scale.py --compare REF[,REF...] [--ranks 256] [--events 1e7] [--jobs 1,2]
                          [--rounds 2] [--keep DIR]

--compare: `analyze --json` of this tree beside gputrace at each git REF (`git archive`),
in alternating rounds on the same files, and a raw columnar scan of them (every file read,
`start_ns` and `end_ns` only, their difference summed): wall time, CPU (one job: the
command's own) and peak RSS and PSS (a page the processes share counted once in all, not
once in each), the best of the rounds each.

--keep DIR writes the traces there once and reuses them on later runs (writing 1e8 events
takes minutes and ~1 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from common import PY, ROOT, machine, table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth  # noqa: E402

from gputrace.analyzers.core.frame import COLUMNS as ANALYZED  # noqa: E402

CLUSTER = """
import sys
from distributed import LocalCluster
c = LocalCluster(n_workers=int(sys.argv[1]), threads_per_worker=1, processes=True,
                 dashboard_address=None, host="127.0.0.1")
print(c.scheduler_address, flush=True)
sys.stdin.read()
c.close()
"""
MERGE = "import sys; from gputrace.record.merge import merge_shards; " \
        "merge_shards(sys.argv[1], sys.argv[2], remove=False)"


def _tree_sum(procs: list[psutil.Process], of: Any) -> float:
    """`of(process)` summed over each process and its descendants still alive."""
    total = 0.0
    for root in procs:
        try:
            members = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in members:
            try:
                total += of(p)
            except psutil.Error:
                pass
    return total


def tree_rss(procs: list[psutil.Process]) -> int:
    return int(_tree_sum(procs, lambda p: p.memory_info().rss))


def tree_pss(procs: list[psutil.Process]) -> int:
    """The proportional set size summed: a page shared by n of the processes (a pool's
    workers forked from its forkserver, whose preloaded modules they share) counts 1/n in
    each, where summed RSS counts it whole in each."""
    return int(_tree_sum(procs, lambda p: p.memory_full_info().pss))


def tree_cpu(procs: list[psutil.Process]) -> float:
    return _tree_sum(procs, lambda p: sum(p.cpu_times()[:2]))


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(cmd: list[str], also: list[psutil.Process] = (), timeout: float = 1800,
            env: dict[str, str] | None = None, cwd: Path = ROOT) -> dict:
    """Run cmd; its wall time, the CPU seconds of it, its children and the processes `also`
    (with theirs) while it ran, and the peak of their summed RSS less what `also` held
    before it started."""
    base = tree_rss(list(also))
    cpu = children_cpu() + tree_cpu(list(also))
    t = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env=None if env is None else dict(os.environ, **env))
    me = psutil.Process(p.pid)
    peak = peak_pss = 0
    base_pss = tree_pss(list(also))
    tick = 0
    while p.poll() is None:
        peak = max(peak, tree_rss([me, *also]) - base)
        if tick % 10 == 0:   # every 0.2 s: reading every page map costs a core's ms each
            peak_pss = max(peak_pss, tree_pss([me, *also]) - base_pss)
        tick += 1
        if time.perf_counter() - t > timeout:
            p.kill()
        time.sleep(0.02)
    wall = time.perf_counter() - t
    err = p.stderr.read() if p.stderr else ""
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err[-3000:]}")
    cpu = children_cpu() + tree_cpu(list(also)) - cpu
    return {"wall_s": wall, "peak_rss_bytes": peak, "peak_pss_bytes": peak_pss, "cpu_s": cpu}


def gib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def traces(root: Path, ranks: int, events: int) -> tuple[Path, int]:
    """A multi-node recording of `ranks` ranks and about `events` events, written once."""
    d = root / f"run-{ranks}r-{events:.0e}"
    done = d / "events.json"
    if done.exists():
        return d / "run.arrow", json.loads(done.read_text())["events"]
    shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    n = synth.write_nodes(d, events, ranks, per_node=8)
    done.write_text(json.dumps({"events": n}))
    print(f"wrote {n:.3g} events of {ranks} ranks in {time.perf_counter() - t:.0f} s "
          f"({sum(f.stat().st_size for f in d.iterdir()) / 2**30:.2f} GiB)", flush=True)
    return d / "run.arrow", n


def start_cluster(workers: int) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([PY, "-c", CLUSTER, str(workers)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    address = p.stdout.readline().strip() if p.stdout else ""
    if not address.startswith("tcp://"):
        raise SystemExit("the local Dask cluster did not start")
    return p, address


def compare(refs: list[str], path: Path, events: int, n_ranks: int, jobs: list[int],
            rounds: int) -> None:
    """This tree beside each ref, alternating, and the raw scan, on the same files."""
    tmp = Path(tempfile.mkdtemp(prefix="gputrace-compare-"))
    trees = {}
    try:
        for ref in refs:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "gputrace"],
                                     capture_output=True, check=True).stdout
            (tmp / ref).mkdir()
            subprocess.run(["tar", "-x", "-C", str(tmp / ref)], input=archive, check=True)
            trees[ref] = str(tmp / ref)
        trees["this tree"] = str(ROOT)
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(rounds):
            runs.setdefault(("raw columnar scan", ""), []).append(
                measure([PY, "-c", synth.SCAN, str(path.parent)]))
            # the same scan of every column the analysis reads (frame.COLUMNS): what
            # reading them alone costs, beside the two the scan above reads
            runs.setdefault(("scan, analyze's columns", ""), []).append(
                measure([PY, "-c", synth.SCAN, str(path.parent), ",".join(ANALYZED)]))
            for j in jobs:
                for name, tree in trees.items():
                    # run outside the checkout (`-m` puts the directory first on
                    # sys.path): the tree on PYTHONPATH, for the pool's workers too
                    cmd = [PY, "-m", "gputrace", "analyze", "--json", "-j", str(j), str(path)]
                    runs.setdefault((name, f"-j {j}"), []).append(
                        measure(cmd, env={"PYTHONPATH": tree}, cwd=tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    scan = {k: min(m[k] for m in runs[("raw columnar scan", "")]) for k in ("wall_s", "cpu_s")}
    rows = []
    for (name, how), ms in runs.items():
        wall, cpu = min(m["wall_s"] for m in ms), min(m["cpu_s"] for m in ms)
        one = how in ("", "-j 1")  # a pool's workers are not the command's children: no CPU
        rows.append([name, how, f"{wall:.1f} s", f"{cpu:.1f} s" if one else "n/a",
                     gib(min(m["peak_rss_bytes"] for m in ms)),
                     gib(min(m["peak_pss_bytes"] for m in ms)), f"{wall / scan['wall_s']:.1f}x",
                     f"{cpu / scan['cpu_s']:.1f}x" if one else "n/a"])
    print(table(f"analyze --json of {events:.2g} events over {n_ranks} ranks, side by side "
                f"({rounds} rounds, the best of each; peak RSS and PSS summed over its "
                "processes)",
                ["tree", "jobs", "time", "CPU", "peak RSS", "peak PSS", "time / scan",
                 "CPU / scan"],
                rows))
    print(f"machine: {machine()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="256,1024")
    ap.add_argument("--events", type=float,
                    help="events at the largest size (default 1e8; with --compare 1e7)")
    ap.add_argument("--merge-events-per-rank", type=float, default=2e4)
    ap.add_argument("--keep", help="write the traces here once, and reuse them")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--compare", metavar="REFS", help="this tree beside git REF[,REF...]")
    ap.add_argument("--jobs", default="1,2", help="with --compare: the -j values")
    ap.add_argument("--rounds", type=int, default=2, help="with --compare")
    a = ap.parse_args()
    if a.compare:
        n_ranks = 16 if a.tiny else int(a.ranks.split(",")[0])
        events = int(2e5 if a.tiny else a.events or 1e7)
        root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="gputrace-scale-"))
        try:
            path, n = traces(root, n_ranks, events)
            compare(a.compare.split(","), path, n, n_ranks,
                    [int(j) for j in a.jobs.split(",")], a.rounds)
        finally:
            if not a.keep:
                shutil.rmtree(root, ignore_errors=True)
        return
    # --tiny: one size, which runs every part of a size (the three ways, the merge) once
    ranks = [16] if a.tiny else [int(x) for x in a.ranks.split(",")]
    top = 1e5 if a.tiny else a.events or 1e8
    per_rank = top / max(ranks)
    merge_per_rank = 2e3 if a.tiny else a.merge_events_per_rank
    tmp = tempfile.mkdtemp(prefix="gputrace-scale-")
    root = Path(a.keep) if a.keep else Path(tmp)
    root.mkdir(parents=True, exist_ok=True)
    rows, merges = [], []
    cluster, address = start_cluster(2)
    try:
        for n_ranks in ranks:
            path, events = traces(root, n_ranks, int(per_rank * n_ranks))
            cmd = [PY, "-m", "gputrace", "analyze", "--json", str(path)]
            runs = {"1 job": measure([*cmd, "--jobs", "1"]),
                    "2 jobs": measure([*cmd, "--jobs", "2"]),
                    "Dask, 2 workers": measure([*cmd, "--dask", address],
                                               also=[psutil.Process(cluster.pid)])}
            for how, m in runs.items():
                rows.append([f"{n_ranks}", f"{events:.2g}", how, f"{m['wall_s']:.1f} s",
                             f"{m['cpu_s']:.1f} s", gib(m["peak_rss_bytes"]),
                             f"{events / m['wall_s'] / 1e6:.2f} M/s"])
            shards = Path(tmp) / f"shards-{n_ranks}"
            shards.mkdir()
            n = synth.write_arrow(shards, int(merge_per_rank * n_ranks), n_ranks, shards=True)
            m = measure([PY, "-c", MERGE, str(shards), str(Path(tmp) / "merged.arrow")])
            merges.append([f"{n_ranks}", f"{n:.2g}", f"{m['wall_s']:.1f} s",
                           f"{m['cpu_s']:.1f} s", gib(m["peak_rss_bytes"])])
            shutil.rmtree(shards)
    finally:
        if cluster.stdin:
            cluster.stdin.close()
        cluster.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    print(table("Analysis of many ranks: gputrace analyze --json of a multi-node recording "
                "(8 ranks per node), peak RSS summed over its processes",
                ["ranks", "events", "how", "time", "CPU", "peak RSS", "events/s"], rows))
    print()
    print(table("Merge of one shard per rank (merge_shards), the same events per rank",
                ["ranks", "events", "time", "CPU", "peak RSS"], merges))
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
