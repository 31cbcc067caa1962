"""Past one machine: one trace file per node, found from the one name the user gave; host
clocks aligned on the collectives every rank ends at once; ranks analyzed in worker
processes and on a Dask cluster; the slowest rank and the outliers named with why.

The launch test runs a real two-node job on this machine: two `torchrun --nnodes 2` (each
under its own `gputrace record`, each "node" with its own hostname), DDP over gloo, one
node's clock moved by a known amount."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from gputrace.record.runner import node_output, spans_nodes
from gputrace.trace import load
from gputrace.trace.writer import write_by_rank
from tests.conftest import GPUTRACE, run_gputrace
from tests.tracebuilder import Builder, ddp_iterations

ROOT = Path(__file__).resolve().parents[1]
UNITS = [((4, 3), 42, 60), ((2, 1), 72, 88)]


def analysis(*args: str) -> dict:
    return json.loads(run_gputrace("analyze", "--json", *args, check=True).stdout)


def write_nodes(d: Path, hosts: dict[str, tuple[float, list[int]]], *, n: int = 8,
                slow: dict[int, float] | None = None, jitter: bool = True) -> None:
    """One file per host, as `record` writes them on each node of a run `run.arrow`:
    hosts: name -> (its clock ahead by ms, its ranks). Every rank ends each comm unit at
    the same true moment, a little late by its own delay (as a completion callback is);
    `slow`: rank -> ms more waiting for data per iteration (its own iterations longer)."""
    d.mkdir(parents=True, exist_ok=True)
    for k, (host, (clock_ms, ranks)) in enumerate(hosts.items()):
        b = Builder(host, clock_ms)
        for r in ranks:
            late = 0.02 * (r % 2) if jitter else 0.0
            units = [(layers, s, e + late) for layers, s, e in UNITS]
            ddp_iterations(b, units, n=n, rank=r, wait=(slow or {}).get(r, 0.0))
        for i in range(30):   # this node's own storage counter
            b.sample("proc.read_bytes", i * 30, i * 4096 * (k + 1))
        b.write_by_rank(d / f"run.{host}.arrow", node_of="run.arrow")


def test_a_run_of_several_nodes_is_found_from_its_name_a_directory_or_a_glob(tmp_path):
    write_nodes(tmp_path / "run", {"nodeA": (0.0, [0, 1]), "nodeB": (7.3, [2, 3])})
    (tmp_path / "run" / "other.arrow").write_bytes(b"")   # not a node of run.arrow
    by_name = analysis(str(tmp_path / "run" / "run.arrow"))
    assert by_name["hosts"] == {"nodeA": [0, 1], "nodeB": [2, 3]}
    assert by_name["world_size"] == 4 and sorted(by_name["ranks"]) == ["0", "1", "2", "3"]
    assert analysis(str(tmp_path / "run" / "run.*.arrow")) == by_name
    os.unlink(tmp_path / "run" / "other.arrow")
    assert analysis(str(tmp_path / "run")) == by_name
    info = json.loads(run_gputrace("info", "--json", str(tmp_path / "run" / "run.arrow"),
                                   check=True).stdout)
    assert info["hosts"] == ["nodeA", "nodeB"]
    p = run_gputrace("analyze", str(tmp_path / "run" / "nothing.*.arrow"))
    assert p.returncode == 2 and "no file matches" in p.stderr and "Traceback" not in p.stderr


def test_host_clock_offsets_are_recovered_applied_and_can_be_left_out(tmp_path):
    write_nodes(tmp_path / "skewed", {"nodeA": (0.0, [0, 1]), "nodeB": (7.3, [2, 3])})
    write_nodes(tmp_path / "true", {"nodeA": (0.0, [0, 1]), "nodeB": (0.0, [2, 3])})
    a = analysis(str(tmp_path / "skewed"))
    b = a["clock"]["hosts"]["nodeB"]
    assert a["clock"]["reference_host"] == "nodeA" and a["clock"]["applied"]
    assert b["offset_s"] == pytest.approx(7.3e-3, abs=1e-6) and b["matched_units"] == 16
    lo, hi = b["bounds_s"]
    assert lo <= 7.3e-3 <= hi
    truth = analysis(str(tmp_path / "true"), "--no-align")
    raw = analysis(str(tmp_path / "skewed"), "--no-align")
    assert raw["clock"]["applied"] is False
    assert raw["clock"]["hosts"]["nodeB"]["offset_s"] == b["offset_s"]   # still reported
    for r in "0123":
        assert a["ranks"][r]["comm_wait_s"] == pytest.approx(truth["ranks"][r]["comm_wait_s"],
                                                             abs=1e-9)
    # left as recorded, node A's ranks seem to wait 7.3 ms per unit for node B's
    assert raw["ranks"]["0"]["comm_wait_s"] > truth["ranks"]["0"]["comm_wait_s"] + 10e-3
    text = run_gputrace("analyze", str(tmp_path / "skewed"), check=True).stdout
    assert "nodeB: +7.300 ms" in text


def test_samples_stay_with_their_host(tmp_path):
    write_nodes(tmp_path / "run", {"nodeA": (0.0, [0, 1]), "nodeB": (0.0, [2, 3])})
    a = analysis(str(tmp_path / "run"))
    disk = {r: a["ranks"][r]["bandwidth"]["disk_bytes_per_iter"] for r in "0123"}
    # node B's counter rises twice as fast as node A's; merged, they would be one sawtooth
    assert disk["0"] == pytest.approx(disk["1"]) and disk["2"] == pytest.approx(disk["3"])
    assert disk["2"] == pytest.approx(2 * disk["0"], rel=1e-6)


def test_the_slowest_rank_and_outliers_are_named_with_why(tmp_path):
    hosts = {f"n{k}": (0.0, list(range(4 * k, 4 * k + 4))) for k in range(4)}
    write_nodes(tmp_path / "run", hosts, slow={13: 12.0})
    a = analysis(str(tmp_path / "run"))
    assert a["slowest_rank"] == 13
    assert [o["rank"] for o in a["outliers"]] == [13]
    o = a["outliers"][0]
    assert o["host"] == "n3" and o["term"] == "t_io"
    assert o["excess_s"] == pytest.approx(12e-3, abs=1e-4) and "waiting for data" in o["why"]
    assert a["slowest"]["rank"] == 13 and a["ranks"]["13"]["host"] == "n3"
    text = run_gputrace("analyze", str(tmp_path / "run"), check=True).stdout
    assert "slowest: rank 13 on n3" in text and "outliers" in text


def test_worker_processes_give_the_analysis_of_one_process(tmp_path):
    hosts = {f"n{k}": (0.5 * k, list(range(3 * k, 3 * k + 3))) for k in range(3)}
    write_nodes(tmp_path / "run", hosts)
    one = analysis(str(tmp_path / "run"), "--jobs", "1")
    two = analysis(str(tmp_path / "run"), "--jobs", "2")
    assert two == one and len(one["ranks"]) == 9


@pytest.fixture(scope="module")
def dask_cluster():
    """A local Dask cluster of 2 worker processes, in a process of its own (as a real
    scheduler runs apart from the client)."""
    pytest.importorskip("distributed")
    code = ("from distributed import LocalCluster\n"
            "import sys\n"
            "c = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, "
            "dashboard_address=None, host='127.0.0.1')\n"
            "print(c.scheduler_address, flush=True)\n"
            "sys.stdin.read()\n"
            "c.close()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = p.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        yield address
    finally:
        p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.mark.slow
def test_64_ranks_on_8_nodes_analyzed_on_a_dask_cluster(tmp_path, dask_cluster):
    hosts = {f"node{k:02d}": (0.25 * k, list(range(8 * k, 8 * k + 8))) for k in range(8)}
    write_nodes(tmp_path / "run", hosts, n=6, slow={45: 15.0})
    local = analysis(str(tmp_path / "run" / "run.arrow"), "--jobs", "1")
    on_dask = analysis(str(tmp_path / "run" / "run.arrow"), "--dask", dask_cluster)
    assert on_dask == local
    assert len(local["ranks"]) == 64 and len(local["hosts"]) == 8
    assert [o["rank"] for o in local["outliers"]] == [45]
    for k in range(1, 8):
        assert local["clock"]["hosts"][f"node{k:02d}"]["offset_s"] == \
            pytest.approx(0.25e-3 * k, abs=1e-6)
    p = run_gputrace("analyze", str(tmp_path / "run"), "--dask", "tcp://127.0.0.1:1")
    assert p.returncode == 2 and "cannot reach the Dask scheduler" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_node_of_several_names_its_file_after_its_host(tmp_path, monkeypatch):
    assert spans_nodes(["torchrun", "--nnodes", "2", "--node_rank", "1", "t.py"])
    assert spans_nodes([sys.executable, "-m", "torch.distributed.run", "--nnodes=1:4", "t.py"])
    assert not spans_nodes(["torchrun", "--standalone", "--nproc_per_node", "2", "t.py"])
    assert not spans_nodes(["python", "t.py", "--nnodes", "2"])   # not torchrun's
    monkeypatch.setenv("SLURM_NNODES", "4")
    assert spans_nodes(["python", "t.py"])
    monkeypatch.delenv("SLURM_NNODES")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "16")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert spans_nodes(["python", "t.py"])
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "9")   # one record per task: its rank too
    assert node_output("out/run.arrow", "gpu-node-7") == "out/run.gpu-node-7.9.arrow"
    for v in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(v)
    assert node_output("out/run.arrow", "a/b c") == "out/run.a_b_c.arrow"
    env = dict(os.environ, GPUTRACE_HOST="nodeZ")
    out = tmp_path / "run.arrow"
    run_gputrace("record", "-q", "--per-host", "-o", str(out), "--", sys.executable, "-c",
                 "pass", env=env, check=True)
    assert not out.exists() and (tmp_path / "run.nodeZ.arrow").exists()
    tr = load(tmp_path / "run.nodeZ.arrow")
    assert tr.metadata["node_of"] == "run.arrow" and tr.metadata["host"] == "nodeZ"
    smp = tr.table.filter(pc.equal(tr.table.column("kind"), "sample"))
    assert smp.num_rows and set(smp.column("host").to_pylist()) == {"nodeZ"}


# -- a real two-node launch on this machine ------------------------------------------------
SHIFT_NS = 25_000_000      # node B's clock, moved for the test only


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0


def _node(host: str, node_rank: int, port: int, shift_ns: int, out: Path, data: Path
          ) -> subprocess.Popen[str]:
    """One node: `gputrace record -- torchrun --nnodes 2 ...` with hostname `host`, in its
    own UTS namespace where we may (else named by GPUTRACE_HOST, as a launcher would)."""
    cmd = [*GPUTRACE, "record", "-q", "-o", str(out), "--", sys.executable, "-m",
           "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
           "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(ROOT / "samples" / "train_cnn.py"), "--preset", "case1", "--width", "4",
           "--fc-hidden", "128", "--batch-size", "8", "--image-size", "32",
           "--bucket-cap-mb", "0.01", "--threads", "1", "--workers", "0", "--samples", "256",
           "--iterations", "30", "--data", str(data)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", GPUTRACE_TEST_CLOCK_SHIFT_NS=str(shift_ns))
    if _can_unshare():
        cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *cmd]
    else:
        env["GPUTRACE_HOST"] = host
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=out.parent)


def _unskewed_copy(src: Path, dst: Path, shift_ns: int) -> None:
    """The node's file with its clock put back: what the run would have given unskewed."""
    tr = load(src)
    t = tr.table
    for c in ("start_ns", "end_ns", "launch_ns"):
        i = t.schema.get_field_index(c)
        t = t.set_column(i, t.schema.field(i), pc.subtract(t.column(c),
                                                           pa.scalar(shift_ns, pa.int64())))
    write_by_rank(dst, tr.metadata, t)


@pytest.mark.slow
def test_two_nodes_under_torchrun_with_skewed_clocks(tmp_path):
    pytest.importorskip("torch")
    run = tmp_path / "run"
    run.mkdir()
    port = _free_port()
    nodes = [_node("nodeA", 0, port, 0, run / "run.arrow", tmp_path / "data"),
             _node("nodeB", 1, port, SHIFT_NS, run / "run.arrow", tmp_path / "data")]
    logs = [p.communicate(timeout=420)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(x[-3000:] for x in logs)
    # one file per node, beside each other, none named run.arrow
    assert sorted(os.listdir(run)) == ["run.nodeA.arrow", "run.nodeB.arrow"]
    for host in ("nodeA", "nodeB"):
        t = load(run / f"run.{host}.arrow").table
        assert set(t.column("host").to_pylist()) == {host}   # samples and spans alike
        assert t.filter(pc.equal(t.column("kind"), "sample")).num_rows > 0
    a = analysis(str(run / "run.arrow"))
    assert a["hosts"] == {"nodeA": [0, 1], "nodeB": [2, 3]} and a["world_size"] == 4
    b = a["clock"]["hosts"]["nodeB"]
    assert b["matched_units"] >= 30
    # within a millisecond of the skew, or (beside a busy neighbour, whose preemptions
    # delay each rank's completions by milliseconds) within three of its stated ± uncertainty
    assert abs(b["offset_s"] - SHIFT_NS / 1e9) < max(1e-3, 3 * b["uncertainty_s"]), b
    lo, hi = b["bounds_s"]
    assert lo <= SHIFT_NS / 1e9 <= hi
    # the same run with node B's clock put back, taken as recorded: the truth
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    shutil.copy(run / "run.nodeA.arrow", fixed / "run.nodeA.arrow")
    _unskewed_copy(run / "run.nodeB.arrow", fixed / "run.nodeB.arrow", SHIFT_NS)
    truth = analysis(str(fixed), "--no-align")
    raw = analysis(str(run), "--no-align")
    err = abs(b["offset_s"] - SHIFT_NS / 1e9)
    units = len(a["ranks"]["0"]["units"])
    for r in "0123":
        mine, true = a["ranks"][r], truth["ranks"][r]
        # what each rank sees of itself does not depend on the other node's clock
        assert mine["overlap"] == true["overlap"] and mine["breakdown"] == true["breakdown"]
        # waiting for peers does: each unit's wait is off by at most the offset's error
        assert mine["comm_wait_s"] == pytest.approx(true["comm_wait_s"], abs=units * err + 1e-6)
        assert mine["comm_transfer_s"] == pytest.approx(true["comm_transfer_s"],
                                                        abs=units * err + 1e-6)
    # as recorded, node A's ranks would seem to wait for node B's 25 ms more in every unit
    assert raw["ranks"]["0"]["comm_wait_s"] > truth["ranks"]["0"]["comm_wait_s"] + 10e-3


def test_two_hosts_recording_into_one_path_at_once_keep_both_traces(tmp_path):
    """A cluster tool that starts one command per node, with RANK and WORLD_SIZE set by hand
    and no launcher variable saying the job spans nodes: both nodes' traces are kept, and
    `analyze run.arrow` finds both."""
    from tests.test_record import record_together

    run = tmp_path / "run"
    run.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "GPUTRACE_HOST"))}
    if _can_unshare():
        def wrap(rank, cmd):
            return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                    f"node{'AB'[rank]}", *cmd]
    else:
        pytest.skip("needs root and unshare --uts to give each recording its own hostname")
    ps = record_together(run / "run.arrow", tmp_path / "barrier", [0, 1], wrap=wrap, env=env)
    assert [p.returncode for p in ps] == [0, 0], [p.stderr for p in ps]
    said = [line for p in ps for line in p.stderr.splitlines() if "run.arrow was" in line]
    assert len(said) == 1 and "beside it" in said[0], said
    files = sorted(os.listdir(run))
    assert len(files) == 2 and "run.arrow" in files, files
    # the part beside is named after its host: nodeA's or nodeB's, whichever came second
    assert set(files) - {"run.arrow"} <= {"run.nodeA.arrow", "run.nodeB.arrow"}
    a = analysis(str(run / "run.arrow"))
    assert a["hosts"] == {"nodeA": [0], "nodeB": [1]}
    assert all(a["ranks"][r]["iterations"]["count"] >= 3 for r in "01")
    info = json.loads(run_gputrace("info", "--json", str(run / "run.arrow"),
                                   check=True).stdout)
    assert info["hosts"] == ["nodeA", "nodeB"]
