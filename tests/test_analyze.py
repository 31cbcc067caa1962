"""Analyzers on hand-built traces with known answers, and the analyze command's contract."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from gputrace.analyzers import analyze
from gputrace.cli import main
from gputrace.fmt import ranges
from gputrace.trace import load
from tests.conftest import run_gputrace
from tests.tracebuilder import Builder, ddp_iterations

CASE1_UNITS = [([4], 40, 50), ([3], 55, 65), ([2], 70, 80), ([1], 85, 90)]
CASE2_UNITS = [([4], 40, 62), ([3], 62, 72), ([2], 72, 84), ([1], 85, 92)]


def run_analysis(tmp_path, b, **kw):
    path = b.write(tmp_path / "t.arrow", world_size=kw.pop("world_size", 1))
    return analyze(load(path), **kw)


def test_case1_every_unit_but_the_last_is_hidden(tmp_path):
    a = run_analysis(tmp_path, ddp_iterations(Builder(), CASE1_UNITS), skip=1)
    r = a.main
    assert r.iterations == 6 and r.warmup_skipped == 1
    bd = {k: s.mean for k, s in r.breakdown.items()}
    assert bd["t_iter"] == pytest.approx(0.100)
    assert bd["t_io"] == pytest.approx(0.005)
    assert bd["t_f"] == pytest.approx(0.025)
    assert bd["t_b"] == pytest.approx(0.055)
    assert bd["t_u"] == pytest.approx(0.008)
    assert bd["t_comm"] == pytest.approx(0.035)
    assert bd["t_other"] == pytest.approx(0.002)
    assert r.comm["hidden_s"] == pytest.approx(0.030)
    assert r.comm["exposed_s"] == pytest.approx(0.005)
    m = r.model
    assert (m.strategy, m.case, m.C, m.C_unit, m.equation) == ("wfbp_update_after", 1, None,
                                                               None, "10")
    assert [u.hidden for u in m.units] == [True, True, True, False]
    assert [u.ready_s for u in m.units] == pytest.approx([0.040, 0.055, 0.070, 0.085])
    assert m.predicted_t_iter == pytest.approx(0.100)
    assert abs(m.relative_error) < 1e-9


def test_case2_with_known_C(tmp_path):
    a = run_analysis(tmp_path, ddp_iterations(Builder(), CASE2_UNITS, update=(92, 98)), skip=1)
    m = a.main.model
    assert m.case == 2
    assert [u.hidden for u in m.units] == [False, False, True, False]
    assert m.C == 3 and m.C_unit == 1  # layers 3..4 / units 0..1 cover every exposed unit
    # exposed comm: 85-92 after the backward ends
    assert a.main.comm["exposed_s"] == pytest.approx(0.007)
    assert m.equation == "5"
    # eq. 5: t_io + t_f + t_b(L) + (tau_e - tau_s) + t_u + t_other = 5+25+10+52+6+2
    assert m.predicted_t_iter == pytest.approx(0.100)
    # the paper's eq. 7: t_io + t_f + comm of units 0..1 (22 + 10) + t_b of layers 1..2
    # (15 + 15) + the last unit (7) + t_u + t_other: it counts the overlapped parts twice
    assert m.eq7_t_iter == pytest.approx(0.005 + 0.025 + 0.032 + 0.030 + 0.007 + 0.006 + 0.002)
    f = {x.id: x for x in a.main.findings}
    assert "comm_exposed" in f and "C = 3" in f["comm_exposed"].message


def test_comm_after_backward_is_sequential(tmp_path):
    units = [([4, 3], 85, 88), ([2, 1], 88, 91)]
    b = ddp_iterations(Builder(), units, update=(91, 98))
    m = run_analysis(tmp_path, b, skip=1).main.model
    assert m.strategy == "sequential" and m.case is None and m.equation == "2"
    assert m.predicted_t_iter == pytest.approx(0.100)


def test_exposed_and_hidden_io(tmp_path):
    b = Builder()
    for k in range(5):
        base = k * 100
        b.span("iteration", base, base + 100, step=k)
        b.span("io", base, base + 20, name="DataLoader.__next__", step=k)       # loop waits
        b.span("io", base + 50, base + 90, name="fetch", pid=2, tid=2)          # worker work
        b.span("forward", base + 20, base + 50, step=k)
        b.span("backward", base + 50, base + 95, step=k)
        b.sample("proc.read_bytes", base, k * 1e6)
        b.sample("proc.read_chars", base, k * 5e6)
    b.sample("proc.read_bytes", 500, 5e6).sample("proc.read_chars", 500, 25e6)
    r = run_analysis(tmp_path, b, skip=1).main
    assert r.io["exposed_s"] == pytest.approx(0.020)
    assert r.io["hidden_s"] == pytest.approx(0.040)
    assert r.io["total_s"] == pytest.approx(0.060)
    assert r.model.io_pipelined and r.model.t_io_pipelined == pytest.approx(0.040)
    f = {x.id: x for x in r.findings}
    assert f["input_bound"].severity == "high"
    assert "0.020 s of 0.100 s" in f["input_bound"].message
    assert r.bandwidth is not None and r.bandwidth.disk_bytes_per_iter == pytest.approx(1e6)
    assert r.bandwidth.cache_bytes_per_iter == pytest.approx(4e6)


def test_moderate_input_wait_and_no_finding_below_5_percent(tmp_path):
    for wait, sev in ((8, "moderate"), (3, None)):
        b = Builder()
        for k in range(4):
            b.span("iteration", k * 100, k * 100 + 100, step=k)
            b.span("io", k * 100, k * 100 + wait, step=k)
            b.span("forward", k * 100 + wait, k * 100 + 100, step=k)
        r = run_analysis(tmp_path, b).main
        got = {x.id: x.severity for x in r.findings}.get("input_bound")
        assert got == sev


def test_pageable_copies_are_a_finding_by_the_time_they_take(tmp_path):
    """Copies from pageable memory are named when they take a share of the iterations'
    time: a few bytes copied from a Python scalar are no finding beside the rest."""
    for ms, sev in ((12.0, "high"), (3.0, "moderate"), (0.002, None)):
        b = Builder()
        for k in range(4):
            b.span("iteration", k * 100, k * 100 + 100, step=k)
            b.span("forward", k * 100, k * 100 + 100, step=k)
            b.span("memcpy", k * 100 + 1, k * 100 + 1 + ms, src_kind="pageable", device=0,
                   stream=7, nbytes=4096)
            b.span("memcpy", k * 100 + 20, k * 100 + 40, src_kind="pinned", device=0,
                   stream=7, nbytes=1 << 28)
        f = {x.id: x for x in run_analysis(tmp_path, b).main.findings}.get("h2d_pageable")
        assert (f.severity if f else None) == sev, (ms, f)
        if f:
            assert f"{4 * ms / 1e3:.3f} s, {ms / 100:.0%} of the iterations' time" in \
                f.message, f.message


def test_many_exposed_units_are_named_as_ranges(tmp_path):
    """A model of hundreds of buckets: the finding names its exposed units as ranges of
    their indices, as the headline does, not one by one."""
    layers = [(ly, 30 + 5 * (12 - ly), 35 + 5 * (12 - ly)) for ly in range(12, 0, -1)]
    units = [([ly], e, e + 12) for ly, _, e in layers]      # each ends after the next is ready
    b = ddp_iterations(Builder(), units, per_layer_bwd=layers, update=(160, 165))
    r = run_analysis(tmp_path, b).main
    exposed = [u.index for u in r.model.units[:-1] if not u.hidden]
    assert len(exposed) > 8, r.model.units
    (f,) = [x for x in r.findings if x.id == "comm_exposed"]
    assert f"units {ranges(exposed)} ({len(exposed)} of {len(r.model.units)}) are exposed" \
        in f.message, f.message
    assert "#" not in f.message, f.message


def test_comm_wait_vs_transfer_across_ranks(tmp_path):
    b = Builder()
    ddp_iterations(b, CASE1_UNITS, rank=0)
    # rank 1 reaches every unit 3 ms later: rank 0 waits 3 ms per unit for its peer
    late = [(ly, s + 3, e) for ly, s, e in CASE1_UNITS]
    ddp_iterations(b, late, rank=1)
    a = run_analysis(tmp_path, b, world_size=2, skip=1)
    assert set(a.ranks) == {0, 1}
    assert a.ranks[0].comm_wait_s == pytest.approx(4 * 0.003)
    assert a.ranks[1].comm_wait_s == pytest.approx(0.0)
    assert a.ranks[1].comm_transfer_s == pytest.approx(0.035 - 4 * 0.003)


def test_comm_wait_and_transfer_are_wall_time_when_buckets_are_in_flight_together(tmp_path):
    """Two buckets queued together (as gloo and NCCL run DDP's): 40-60 and 45-70 ms on
    rank 0, rank 1 reaching each 3 ms later. Summed per bucket, rank 0 would wait 6 ms and
    transfer 39 in 30 ms of comm; as wall time it waits 3 (40-43: in flight, nothing
    moving) and transfers 27 (43-70), which add up to its gradient comm."""
    units = [([4], 40, 60), ([3], 45, 70)]
    b = Builder()
    ddp_iterations(b, units, rank=0)
    ddp_iterations(b, [(ly, s + 3, e) for ly, s, e in units], rank=1)
    a = run_analysis(tmp_path, b, world_size=2, skip=1)
    r0, r1 = a.ranks[0], a.ranks[1]
    assert r0.comm_wait_s == pytest.approx(0.003) and r0.comm_transfer_s == pytest.approx(0.027)
    assert r1.comm_wait_s == pytest.approx(0.0) and r1.comm_transfer_s == pytest.approx(0.027)
    for r in (r0, r1):
        assert r.comm_wait_s + r.comm_transfer_s == pytest.approx(r.breakdown["t_comm"].mean)
    # the prediction's kept wait is the last bucket's own, and says so (not the rank's)
    assert any("3.0 ms per iteration the last unit spent waiting for the last rank" in s
               for s in r0.speedup.assumptions), r0.speedup.assumptions



def test_comm_across_ranks_says_what_of_the_gradient_comm_it_covers(tmp_path):
    """A bucket only rank 0 shows (80-85 ms) is gradient comm but no wait for peers: the
    line says its 30 ms of the 35."""
    from gputrace.report.terminal import render

    units = [([4], 40, 60), ([3], 45, 70)]
    b = Builder()
    ddp_iterations(b, units + [([1], 80, 85)], rank=0)
    ddp_iterations(b, [(ly, s + 3, e) for ly, s, e in units], rank=1)
    a = run_analysis(tmp_path, b, world_size=2, skip=1)
    out = io.StringIO()
    render(a, rank=0, file=out, width=400)
    (line,) = [ln for ln in out.getvalue().splitlines() if ln.startswith("comm across ranks")]
    assert "3.0 ms waiting for peers, 27.0 ms transferring, per iteration: 30.0 ms of the " \
           "35.0 ms of gradient comm" in line, line


def test_speedup_points_and_eq12(tmp_path):
    a = run_analysis(tmp_path, ddp_iterations(Builder(), CASE1_UNITS), skip=1, world_size=2,
                     gpus=(2, 4, 8), link_bytes_per_s=1e9)
    sp = a.main.speedup
    assert [p.gpus for p in sp.points] == [2, 4, 8]
    assert sp.equation == "11"
    # at the measured size the prediction is the measured iteration
    assert sp.points[0].t_iter == pytest.approx(a.main.model.predicted_t_iter)
    assert sp.points[0].speedup < sp.points[1].speedup < sp.points[2].speedup
    assert all(p.efficiency <= 1.0 for p in sp.points)
    # eq. 12: 4 MB of gradients x 2 ranks in 35 ms at 1 GB/s
    assert sp.allreduce_efficiency == pytest.approx(4e6 * 2 / (0.035 * 1e9))


def test_speedup_is_not_made_up_when_compute_was_not_measured(tmp_path):
    """Iterations and gradient comm but no forward or backward phase (a GPU trace whose
    kernels were attributed to none): no speedup is predicted, and the report says why
    rather than printing 0.00x."""
    b = Builder()
    for k in range(6):
        b.span("iteration", k * 100, k * 100 + 100, step=k)
        b.span("comm", k * 100 + 40, k * 100 + 60, name="allreduce", layer=0, step=k, tid=9,
               nbytes=1_000_000, layers=[1])
    path = b.write(tmp_path / "t.arrow", world_size=2)
    sp = analyze(load(path)).main.speedup
    assert sp.points == [] and "t_f and t_b not measured" in sp.unavailable
    d = json.loads(run_gputrace("analyze", str(path), "--json", check=True).stdout)
    assert d["speedup"]["points"] == [] and "not measured" in d["speedup"]["unavailable"]
    out = run_gputrace("analyze", str(path), check=True).stdout
    assert "Predicted speedup: not computed (t_f and t_b not measured" in out
    assert "0.00x" not in out


DESIGN_KEYS = {"format", "version", "iterations", "breakdown", "overlap", "model", "units",
               "speedup", "bandwidth", "findings", "ranks"}


def test_analyze_json_has_the_design_keys(tmp_path):
    path = ddp_iterations(Builder(), CASE2_UNITS).write(tmp_path / "t.arrow")
    p = run_gputrace("analyze", str(path), "--json", check=True)
    d = json.loads(p.stdout)
    assert DESIGN_KEYS <= set(d)
    assert d["format"] == "gputrace-analysis" and d["version"] == 1
    assert set(d["iterations"]) >= {"count", "warmup_skipped"}
    assert set(d["breakdown"]) >= {"t_iter", "t_io", "t_h2d", "t_f", "t_b", "t_u", "t_comm"}
    assert set(d["breakdown"]["t_iter"]) == {"mean", "std"}
    assert set(d["overlap"]["comm"]) >= {"total_s", "hidden_s", "exposed_s", "hidden_fraction"}
    assert set(d["model"]) >= {"strategy", "case", "C", "C_unit", "equation",
                               "predicted_t_iter", "measured_t_iter", "relative_error"}
    assert d["model"]["case"] == 2 and d["model"]["C"] == 3
    assert set(d["units"][0]) >= {"index", "layers", "bytes", "ready_s", "start_s", "end_s",
                                  "hidden"}
    assert DESIGN_KEYS - {"format", "version", "ranks"} <= set(d["ranks"]["0"])
    assert all(set(f) == {"id", "severity", "message"} for f in d["findings"])


def test_terminal_report_reads_headline_first(tmp_path):
    path = ddp_iterations(Builder(), CASE2_UNITS).write(tmp_path / "t.arrow")
    p = run_gputrace("analyze", str(path), check=True)
    first = p.stdout.splitlines()[0]
    assert "per iteration" in first and "Case 2" in first
    for text in ("Table V", "t_comm", "Hidden vs exposed", "eq. 5 predicts", "Findings"):
        assert text in p.stdout


@pytest.mark.parametrize("args,needle", [
    (["/no/such/file.arrow"], "no such file"),
    (["--rank", "7", "TRACE"], "no rank 7"),
    (["--gpus", "two", "TRACE"], "--gpus"),
    (["--link-bandwidth", "fast", "TRACE"], "bandwidth"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    path = ddp_iterations(Builder(), CASE1_UNITS, n=2).write(tmp_path / "t.arrow")
    args = [str(path) if a == "TRACE" else a for a in args]
    p = run_gputrace("analyze", *args)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and needle in p.stderr
    assert "Traceback" not in p.stderr


def test_garbage_and_empty_traces_exit_2(tmp_path):
    g = tmp_path / "g.arrow"
    g.write_bytes(b"\x00" * 100)
    p = run_gputrace("analyze", str(g))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    only_samples = Builder().sample("proc.read_bytes", 0, 1).write(tmp_path / "s.arrow")
    p = run_gputrace("analyze", str(only_samples))
    assert p.returncode == 2 and "no spans" in p.stderr


def test_link_bandwidth_units():
    from gputrace.analysis.run import parse_bandwidth

    assert parse_bandwidth("7GB/s") == 7e9
    assert parse_bandwidth("56Gb/s") == 7e9
    assert parse_bandwidth("1GiB/s") == 1024**3
    assert parse_bandwidth("12.5e9") == 12.5e9


def test_a_recommendation_cites_the_replay_and_never_contradicts_it(tmp_path):
    """Case 1 with a costly last unit: the finding about it cites the what-if replay's
    prediction for smaller buckets, and recommends them only where the replay says they
    would help."""
    units = [([4], 40, 50), ([3], 55, 65), ([2], 70, 80), ([1], 85, 97)]
    a = run_analysis(tmp_path, ddp_iterations(Builder(), units, update=(97, 99)), skip=1,
                     world_size=2)
    ra = a.main
    (f,) = [f for f in ra.findings if f.id == "comm_tail"]
    own = [o for o in ra.replay.outcomes if o.scenario.gpus == 2 and
           o.scenario.bandwidth_x == 1 and o.scenario.bucket_bytes is not None]
    best = min(own, key=lambda o: o.t_iter)
    assert f"{best.t_iter * 1e3:.1f} ms" in f.message and "replay" in f.message
    helps = best.t_iter < 0.98 * ra.replay.measured_t_iter
    assert ("would shorten it" in f.message) == helps
    assert ("finds no bucket size" in f.message) == (not helps)


def test_ranks_sharing_a_hosts_cores_are_said_to(tmp_path):
    """Two ranks computing on the CPU of one host share its cores: the speedup keeps their
    measured compute and says so (text and --json)."""
    b = Builder()
    for r in (0, 1):
        ddp_iterations(b, CASE1_UNITS, rank=r)
    path = b.write(tmp_path / "t.arrow", world_size=2, hosts=["node7"], cpus=2)
    sp = analyze(load(path)).main.speedup
    assert sp.shared == "the 2 CPU cores of host node7 (2 ranks computing on it)"
    assert any("shared the 2 CPU cores of host node7" in x for x in sp.assumptions)
    d = json.loads(run_gputrace("analyze", str(path), "--json", check=True).stdout)
    assert d["speedup"]["shared"] == sp.shared
    one = Builder()
    ddp_iterations(one, CASE1_UNITS, rank=0)
    assert analyze(load(one.write(tmp_path / "one.arrow", hosts=["node7"]))).main.speedup \
        .shared is None


def test_a_wait_for_the_last_rank_is_not_scaled_with_the_ring(tmp_path):
    """One unit after backward: rank 0 starts it at 85 ms, rank 1 at 89 ms, both end at 95.
    Only the 6 ms after rank 1 arrives move bytes; rank 0's 4 ms wait stays as it is at any
    GPU count, so both ranks predict the same growth: 6 ms x (2(N-1)/N) / 1."""
    b = Builder()
    ddp_iterations(b, [([4, 3, 2, 1], 85, 95)], rank=0, update=(95, 99))
    ddp_iterations(b, [([4, 3, 2, 1], 89, 95)], rank=1, update=(95, 99))
    a = run_analysis(tmp_path, b, world_size=2, skip=1, gpus=(2, 8))
    for r in (0, 1):
        sp = a.ranks[r].speedup
        assert sp.equation == "8"
        p2, p8 = sp.points
        assert p8.t_iter - p2.t_iter == pytest.approx(0.006 * (2 * 7 / 8 - 1), rel=1e-6), r
    assert any("waiting for the last rank" in s for s in a.ranks[0].speedup.assumptions)


SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.parametrize("source", ["recorded", "kineto/control.json.gz",
                                    "nsys/mfu_2gpu_before.sqlite"])
def test_the_command_runs_without_pandas_and_says_what_it_says_with_it(tmp_path, source):
    """`gputrace analyze` never imports pandas (pyarrow would, to ask whether objects are
    pandas ones: 0.4 s of CPU at each command's start), and prints what `main` prints inside
    a process where pyarrow has pandas to ask; on a 2-rank trace and on real traces other
    tools wrote."""
    if source == "recorded":
        b = Builder()
        ddp_iterations(b, CASE1_UNITS, rank=0)
        ddp_iterations(b, [(ly, s + 3, e) for ly, s, e in CASE1_UNITS], rank=1)
        trace = b.write(tmp_path / "t.arrow", world_size=2)
    else:
        trace = SHARED / source
        if not trace.exists():
            pytest.skip(f"{trace} is not here")
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "gputrace", "analyze",
                        str(trace), "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in p.stderr.splitlines()
                if ln.startswith("import time:")]
    # (a refused `import pandas` is timed too: none of its modules is)
    assert "pyarrow" in imported and not [m for m in imported if m.startswith("pandas.")]
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        assert main(["analyze", str(trace), "--json"]) == 0
    import pyarrow.lib

    assert pyarrow.lib._pandas_api.have_pandas     # the process beside it has pandas
    assert json.loads(p.stdout) == json.loads(out.getvalue())


def test_the_commands_analysis_workers_run_without_pandas(tmp_path):
    """`analyze -j 2`'s worker process analyzes ranks as the command does, without pandas
    (each worker that imported it held ~40 MiB more, at 1e8 events over 1024 ranks 170 ->
    136 MiB), and gives the JSON of `-j 1`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import synth

    trace = tmp_path / "run.arrow"
    synth.write_arrow(trace, 60_000, ranks=4)
    out = {}
    for jobs in ("1", "2"):
        p = subprocess.run([sys.executable, "-X", "importtime", "-m", "gputrace", "analyze",
                            str(trace), "--json", "-j", jobs],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        imported = [ln.rsplit("|", 1)[-1].strip() for ln in p.stderr.splitlines()
                    if ln.startswith("import time:")]
        # -X importtime goes to the spawned worker too: the command and its worker each
        # made themselves a process without pandas
        processes = imported.count("gputrace.analysis.nopandas")
        assert processes == int(jobs), (jobs, processes)
        assert not [m for m in imported if m.startswith("pandas.")], jobs
        out[jobs] = json.loads(p.stdout)
    assert out["1"] == out["2"]
