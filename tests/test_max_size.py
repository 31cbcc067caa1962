"""`record --max-size SIZE`: a real 2-rank gloo DDP job recorded with a ring of detail much
smaller than its run, killed with kill -9 (record and job) and recovered: the last
iterations before the kill are there in full detail, every earlier one keeps its time
(checked against the job's own perf_counter clock, logged as it ran), and the shards on
disk stayed within SIZE per process the whole time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gputrace.trace import load  # noqa: E402
from gputrace.trace.shards import find  # noqa: E402
from tests.conftest import GPUTRACE, run_gputrace  # noqa: E402
from tests.test_window import DETAIL, JOB, _agree  # noqa: E402

pytestmark = pytest.mark.slow

SIZE = 300_000       # ~75 iterations of this job's detail: rotated many times over
LAYERS = 24
ITERATIONS = 250     # done by each rank before the kill: the ring turns over ~3 times


def _kill_tree(pid: int) -> None:
    """kill -9 of `record` and its job, whatever process groups they made (record and
    torchrun each start their children in a session of their own)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _progress(path: Path, rank: int) -> list[tuple[int, float, float]]:
    """The job's own log of the iterations it finished: (step, wall, t_iter)."""
    f = Path(f"{path}.rank{rank}")
    if not f.exists():
        return []
    out = []
    for line in f.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), float(parts[1]), float(parts[2])))
    return out


def _detail_bytes(shard_dir: str, every: bool = False) -> dict[str, int]:
    """Bytes of detail segments on disk per process (its shard's name before `.dN`; the
    host sampler's ticks left out: `samples`, those kept: `ticks`); `every`: every file by
    its name."""
    out: dict[str, int] = {}
    try:
        names = os.listdir(shard_dir)
    except OSError:
        return out
    for n in names:
        if every:
            with contextlib.suppress(OSError):
                out[n] = os.path.getsize(os.path.join(shard_dir, n))
        elif ".d" in n and n.endswith(".spans"):
            try:
                size = os.path.getsize(os.path.join(shard_dir, n))
            except OSError:   # deleted as it was listed
                continue
            key = n.rsplit(".d", 1)[0]
            out[key] = out.get(key, 0) + size
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    d = tmp_path_factory.mktemp("maxsize")
    out, prog = d / "k.arrow", d / "prog"
    rec = subprocess.Popen(
        [*GPUTRACE, "record", "-q", "-o", str(out), "--max-size", "300KB", *DETAIL[:-1],
         "torch,host", "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", JOB, str(d / "k.json"), "--iterations", "100000", "--progress", str(prog)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    most, seen_segments, sampler_most = 0, set(), 0
    try:
        deadline = time.time() + 240
        # until each rank has done far more iterations than SIZE holds, watching the disk
        while time.time() < deadline and min(len(_progress(prog, r)) for r in (0, 1)) < ITERATIONS:
            assert rec.poll() is None, rec.communicate()[1][-3000:]
            dirs = find(str(out))
            if dirs:
                sizes = _detail_bytes(dirs[0])
                most = max([most, *sizes.values()])
                sampler_most = max(sampler_most, sizes.get("samples", 0) + sizes.get("ticks", 0))
                seen_segments.update(n for n in os.listdir(dirs[0]) if ".d" in n)
            time.sleep(0.05)
        time.sleep(0.5)
        kill_wall = time.time()
    finally:
        _kill_tree(rec.pid)
        rec.communicate(timeout=60)
    (shard_dir,) = find(str(out))
    at_kill = _detail_bytes(shard_dir)
    files = _detail_bytes(shard_dir, every=True)
    p = run_gputrace("recover", str(out), check=True)
    truth = {r: _progress(prog, r) for r in (0, 1)}
    return {"out": out, "truth": truth, "kill_wall": kill_wall, "most": most,
            "segments": seen_segments, "at_kill": at_kill, "recover": p.stdout,
            "sampler_most": sampler_most, "files": files}


@pytest.fixture(scope="module")
def killed_json(killed):
    return json.loads(run_gputrace("analyze", str(killed["out"]), "--json", "--skip", "0",
                                   check=True).stdout)


def test_detail_on_disk_stays_within_max_size(killed):
    # many segments were made and dropped: the ring turned over
    assert len(killed["segments"]) >= 8, killed["segments"]
    assert 0 < killed["most"] <= SIZE, killed["most"]
    # the two ranks' and the host sampler's two (its ticks left out: samples.dN, those
    # kept: ticks.dN)
    assert {"samples", "ticks"} <= set(killed["at_kill"]), killed["at_kill"]
    assert len(killed["at_kill"]) == 4 and all(0 < b <= SIZE for b in killed["at_kill"].values())


# what docs/recording.md allows beside SIZE per process: a process's own shard holds its
# metadata (a few KB, written again as it learns more) and, a rank's, a `run` entry per
# iteration (~25 bytes before the merge) and its few instants and memory samples a second
SHARD_BASE, PER_ITERATION = 16_000, 40


def test_everything_on_disk_within_max_size(killed):
    """The host sampler's ticks count in SIZE (both its rings together, at every look while
    the job ran), and the whole shard directory at the kill holds SIZE per process and what
    the docs allow beside it, by the iterations the job itself logged."""
    assert 0 < killed["sampler_most"] <= SIZE, killed["sampler_most"]
    files = killed["files"]
    sampler = sum(b for n, b in files.items() if n.split(".")[0] in ("samples", "ticks",
                                                                     "record"))
    assert sampler <= SIZE + SHARD_BASE, files
    # the sampler's own shards (record's, and each ring's beside its segments) grow by no
    # tick but the first
    for n, b in files.items():
        if n in ("record.spans", "samples.spans", "ticks.spans"):
            assert b <= SHARD_BASE, (n, b)
    iterations = sum(len(v) for v in killed["truth"].values())
    allowed = 3 * SIZE + 3 * SHARD_BASE + PER_ITERATION * iterations
    assert sum(files.values()) <= allowed, (sum(files.values()), allowed, files)


def test_last_iterations_before_the_kill_are_there_in_full(killed):
    t = load(killed["out"]).table
    rows = t.filter(_cats(t, ("iteration", "backward"))) \
        .select(["cat", "rank", "step", "layer"]).to_pylist()
    for rank in (0, 1):
        its = sorted(r["step"] for r in rows if r["rank"] == rank and r["cat"] == "iteration")
        assert its and its == list(range(its[0], its[-1] + 1)), rank
        # the job's iterations that ended a second and a half before the kill are recorded
        done = [s for s, wall, t_iter in killed["truth"][rank]
                if wall + t_iter < killed["kill_wall"] - 1.5]
        assert its[-1] >= done[-1], (rank, its[-1], done[-1])
        assert its[0] > 100, "the ring kept everything: nothing was dropped"
        # every iteration kept in detail is whole: each of the 24 layers' backward
        layers: dict[int, set[int]] = {}
        for r in rows:
            if r["rank"] == rank and r["cat"] == "backward" and r["layer"] > 0:
                layers.setdefault(r["step"], set()).add(r["layer"])
        whole = [s for s in its if len(layers.get(s, ())) == LAYERS]
        assert whole == its, (rank, sorted(set(its) - set(whole))[:10])
        # and no layer span of an iteration whose detail was dropped
        assert min(layers) >= its[0], rank
    assert "kept the detail of iterations" in killed["recover"], killed["recover"]


def _cats(t, cats):
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.is_in(t["cat"].cast(pa.string()), pa.array(list(cats)))


def test_every_iteration_keeps_its_time(killed, killed_json):
    run = killed_json["run"]
    truth = killed["truth"][run["rank"]]
    got = dict(zip(run["step"], run["t_iter_s"], strict=True))
    assert run["step"] == sorted(set(run["step"])), "an iteration counted twice"
    # every iteration the job finished, but those in its last 1.5 s, with its time
    done = [(s, t_iter) for s, wall, t_iter in truth
            if wall + t_iter < killed["kill_wall"] - 1.5]
    missing = [s for s, _ in done if s not in got]
    assert not missing, missing[:10]
    _agree(np.array([got[s] for s, _ in done]), np.array([t for _, t in done]))
    w = killed_json["window"]
    assert w["max_size"] == SIZE and w["iterations"] > 0
    assert w["last_step"] == run["step"][-1] or w["last_step"] >= done[-1][0]
    assert sum(run["inside_window"]) == w["iterations"] < len(run["step"])


# one process, 24 layers, ITERS iterations; it says how many it ran
LOOP = """
import sys, torch
from torch import nn
torch.set_num_threads(1)
m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(24)])
o = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(8, 16)
n = int(sys.argv[1])
for i in range(n):
    m(x).sum().backward(); o.step(); o.zero_grad()
print(n)
"""


def test_clean_run_says_what_was_dropped(tmp_path):
    job = tmp_path / "loop.py"
    job.write_text(LOOP)
    out = tmp_path / "c.arrow"
    p = run_gputrace("record", "-q", "-o", str(out), "--max-size", "100KB", *DETAIL, "--",
                     sys.executable, str(job), "400", timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "400", p.stderr[-3000:]
    t = load(out).table
    kept = sorted(x["step"] for x in t.filter(_cats(t, ("iteration",))).to_pylist())
    # the last iteration ends where the job does (no step after it): 399 are whole
    assert kept and kept[-1] >= 398 and kept[0] > 0, kept
    assert kept == list(range(kept[0], kept[-1] + 1))
    line = [x for x in p.stderr.splitlines() if x.startswith("gputrace: --max-size")]
    assert line == [f"gputrace: --max-size 100KB kept the detail of iterations "
                    f"{kept[0]}..{kept[-1]} of the job; {kept[0]} earlier ones keep their "
                    "times only"], p.stderr[-2000:]
    run = json.loads(run_gputrace("analyze", str(out), "--json", "--skip", "0",
                                  check=True).stdout)["run"]
    assert run["step"] == list(range(kept[-1] + 1))


@pytest.mark.parametrize("bad", ["abc", "10KB", "-5MB"])
def test_bad_max_size_is_one_line_and_exit_2(tmp_path, bad):
    p = run_gputrace("record", "-o", str(tmp_path / "x.arrow"), "--max-size", bad, "--", "true")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--max-size" in p.stderr and not (tmp_path / "x.arrow").exists()
    if bad == "abc":     # the example a --max-size takes, not --link-bandwidth's
        assert "write e.g. 500KB or 5MB" in p.stderr, p.stderr


def test_session_keeps_the_same_ring(tmp_path):
    out = tmp_path / "s.arrow"
    code = (
        "import torch, gputrace, gputrace.torch\n"
        f"with gputrace.Session({str(out)!r}, sampler=False, max_size='64KB') as s:\n"
        "    gputrace.torch.instrument(session=s, gpu_timeline=None)\n"
        "    m = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(24)])\n"
        "    o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "    for _ in range(300):\n"
        "        m(torch.randn(2, 16)).sum().backward(); o.step(); o.zero_grad()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, GPUTRACE_LAYERS="leaves"))
    assert p.returncode == 0, p.stderr
    t = load(out).table.to_pylist()
    its = sorted(r["step"] for r in t if r["cat"] == "iteration")
    assert its == list(range(its[0], 300)) and its[0] > 0, its
    assert f"kept the detail of iterations {its[0]}..299 of the job" in p.stderr, p.stderr
    from gputrace.window import unpack
    runs = sorted(s for r in t if r["cat"] == "run"
                  for s, *_ in unpack(r["start_ns"], r["end_ns"], r["step"], r["args"]))
    assert runs == list(range(300))
    with pytest.raises(ValueError):
        import gputrace
        gputrace.Session(str(tmp_path / "y.arrow"), max_size="1KB")

