"""Run a command under gputrace: sample it from outside, let its Python processes write shards,
forward signals, merge, and exit with the command's own code."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from gputrace.collectors import (
    ALL_COLLECTORS,
    IN_PROCESS_COLLECTORS,
    SYSTEM_COLLECTORS,
    Sampler,
    SystemCollector,
    Unavailable,
    in_process_status,
    make_system_collector,
)
from gputrace.fmt import reason
from gputrace.metadata import base_metadata
from gputrace.probe import embed as embed_probe
from gputrace.record import BOOTSTRAP_DIR
from gputrace.record.job import Forwarder, spawn, wait_job
from gputrace.record.nodes import node_output, spans_nodes
from gputrace.record.summary import print_summary
from gputrace.recorder import capture
from gputrace.recorder.clock import Clock, anchors_report
from gputrace.recorder.core import Recorder
from gputrace.trace import frames, shards
from gputrace.window_pack import RUN_KEYS

_TF_STEPS = re.compile(r"^(\d+:[1-9]\d*|all|off)$")


class RecordError(Exception):
    """A problem with the request itself (exit 2, nothing was run)."""


@dataclass
class RecordOptions:
    command: list[str]
    output: str = "trace.arrow"
    hz: float = 50.0
    collectors: list[str] = field(default_factory=lambda: list(ALL_COLLECTORS))
    force: bool = False
    redact_argv: bool = False
    kill_after_s: float = 10.0
    quiet: bool = False
    gpu_timeline: str = "auto"     # auto | cupti | kineto
    per_host: bool | None = None   # host in the file name (None: when the job spans nodes)
    node_of: str = ""              # with per_host: the name given (-o), the run's name
    tf_steps: str | None = None    # START:COUNT | all | off (TensorFlow's profiler window)
    layers: str | None = None      # blocks | leaves | off (PyTorch modules timed)
    layer_forward: bool = False    # their forward spans too
    flops: str = "on"              # on | off: one iteration's FLOPs counted (PyTorch)
    pp_probe: bool = False         # pipeline stages timed at other microbatch sizes at exit
    steps: str | None = None       # START:COUNT: the iterations recorded in full
    delay_s: float | None = None   # or the seconds recorded in full: from delay_s after the
    duration_s: float | None = None  # job starts, for duration_s
    on_demand: bool = False        # no window until `gputrace capture` (or SIGUSR2) opens one
    capture_steps: int = 20        # the iterations a window opened by SIGUSR2 holds
    max_size: str | None = None    # e.g. 5MB: detail kept on disk per process (a ring)


@dataclass
class RecordResult:
    exit_code: int
    output: str | None
    duration_s: float
    summary: dict[str, Any]


def child_env(shard_dir: str, redact_argv: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUTRACE_SHARD_DIR"] = shard_dir
    env.pop("GPUTRACE_DISABLE", None)
    if redact_argv:
        env["GPUTRACE_REDACT_ARGV"] = "1"
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + pp if pp else "")
    return env


__all__ = ["RecordError", "RecordOptions", "RecordResult", "node_output", "record",
           "spans_nodes"]


def check_output(path: str, force: bool) -> None:
    """Refuse an output that is a directory, or a trace that exists (without -f). An output
    that cannot be written is not refused: the job runs untraced (see `record`). A file that
    another recording puts there while this one runs is not replaced (see `place`)."""
    if os.path.isdir(path):
        raise RecordError(f"{path} is a directory; give a file name with -o")
    if os.path.exists(path) and not force:
        raise RecordError(f"{path} exists; use -f to overwrite it or -o to choose another name")


def _check(opts: RecordOptions) -> None:
    """What is wrong with the request itself (RecordError: exit 2, nothing is run)."""
    if not opts.command:
        raise RecordError("no command given: gputrace record [options] -- CMD ...")
    bad = [c for c in opts.collectors if c not in ALL_COLLECTORS]
    if bad:
        raise RecordError(f"unknown collector(s) {', '.join(bad)}; "
                          f"choose from {', '.join(ALL_COLLECTORS)}")
    if opts.gpu_timeline not in ("auto", "cupti", "kineto"):
        raise RecordError(f"--gpu-timeline is auto, cupti or kineto, not {opts.gpu_timeline!r}")
    if opts.tf_steps is not None and not _TF_STEPS.match(opts.tf_steps):
        raise RecordError(f"--tf-steps is START:COUNT (e.g. 5:10), all or off, "
                          f"not {opts.tf_steps!r}")
    from gputrace.window import WindowError, make

    try:
        make(opts.steps, opts.delay_s, opts.duration_s, on_demand=opts.on_demand)
    except WindowError as e:
        raise RecordError(str(e)) from None
    if opts.max_size is not None:
        from gputrace.recorder.ring import MaxSizeError, parse_size

        try:
            parse_size(opts.max_size)
        except MaxSizeError as e:
            raise RecordError(str(e)) from None
    if not (0 < opts.capture_steps < 1e9):
        raise RecordError("--capture-steps takes a number of iterations, 1 or more")
    if not (0 < opts.hz <= 10_000):
        raise RecordError("--hz must be between 0 and 10000")
    if not (0 < opts.kill_after_s < 1e6):
        raise RecordError("--kill-after takes seconds greater than 0")
    check_output(opts.output, opts.force)


def output_of(opts: RecordOptions) -> RecordOptions:
    """The options with the file this node writes: the name given, or with several nodes
    (one `record` on each), that name with this host's in it."""
    per_host = spans_nodes(opts.command) if opts.per_host is None else opts.per_host
    if not per_host:
        return opts
    from dataclasses import replace

    from gputrace.metadata import hostname

    return replace(opts, output=node_output(opts.output, hostname()), per_host=True,
                   node_of=os.path.basename(opts.output))


def _run_untraced(opts: RecordOptions) -> RecordResult:
    t0 = time.monotonic()
    fwd = Forwarder(opts.kill_after_s)
    proc = spawn(list(opts.command), dict(os.environ), fwd)
    if isinstance(proc, int):
        return RecordResult(proc, None, 0.0, {})
    return RecordResult(wait_job(proc, fwd), None, time.monotonic() - t0, {})


def _prepare(opts: RecordOptions, shard_dir: str, clock: Clock
             ) -> tuple[Recorder, dict[str, str]]:
    """record's own recorder (its shard: the samples, the run's metadata) and the job's
    environment."""
    argv = list(opts.command)
    md = base_metadata("record", argv=argv, rank=-1)
    # the run this file is a part of: `analyze run.arrow` finds every node's file, and the
    # file of a recording that found run.arrow taken by another of the same moment
    md["node_of"] = opts.node_of or os.path.basename(opts.output)
    if opts.redact_argv:
        from gputrace.metadata import redact_argv
        md["argv"] = redact_argv(argv)
    md["sample_hz"] = opts.hz
    embed_probe(md)
    # the sources' modules are loaded before the job starts, so that its first sample is
    # taken as it starts (loading the host collector, which brings pyarrow, took 0.25 s)
    for name in SYSTEM_COLLECTORS:
        if name in opts.collectors:
            with contextlib.suppress(Exception):
                importlib.import_module(f"gputrace.collectors.{name}")
    # its write errors are said once, at the end, with where the data is
    rec = Recorder(os.path.join(shard_dir, "record" + frames.SUFFIX), md, clock=clock,
                   quiet=True).start()
    env = child_env(shard_dir, opts.redact_argv)
    env["GPUTRACE_GPU_TIMELINE"] = opts.gpu_timeline
    if opts.tf_steps is not None:
        env["GPUTRACE_TF_STEPS"] = opts.tf_steps
    from gputrace.window import ENV, make

    win = make(opts.steps, opts.delay_s, opts.duration_s, origin_ns=clock.now_ns(),
               on_demand=opts.on_demand)
    if win is not None:
        env[ENV] = win.env()
        md["window"] = win.describe()
    if opts.max_size is not None:
        from gputrace.recorder import ring

        size = ring.parse_size(opts.max_size)
        env[ring.ENV] = str(size)
        ring.mark(md, size)   # record's own shard holds no iterations: not a ring
    if opts.layers is not None:
        env["GPUTRACE_LAYERS"] = opts.layers
    if opts.layer_forward:
        env["GPUTRACE_LAYER_FORWARD"] = "1"
    if opts.flops == "off":
        env["GPUTRACE_FLOPS"] = "off"
    if opts.pp_probe:   # collectors.torch.pp_probe.ENV (that package imports torch)
        env["GPUTRACE_PP_PROBE"] = "1"
        md["pp_probe"] = True   # asked for: a pipeline no stage of which was probed says so
    for name in IN_PROCESS_COLLECTORS:
        if name not in opts.collectors:
            env[f"GPUTRACE_NO_{name.upper()}"] = "1"
            rec.set_collector(name, "off: not in --collectors")
        else:
            rec.set_collector(name, in_process_status(name))
    return rec, env


def _start_sampler(opts: RecordOptions, rec: Recorder, clock: Clock, pid: int
                   ) -> tuple[Sampler, list[SystemCollector]]:
    collectors: list[SystemCollector] = []
    for name in SYSTEM_COLLECTORS:
        if name not in opts.collectors:
            rec.set_collector(name, "off: not in --collectors")
            continue
        try:
            c = make_system_collector(name, pid, rec.host)
        except Unavailable as e:
            rec.set_collector(name, f"unavailable: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - a broken source is said, not fatal
            rec.set_collector(name, f"unavailable: {reason(e)}")
            continue
        collectors.append(c)
    sampler = Sampler(collectors, thinner(rec, opts, os.path.dirname(rec.path)), opts.hz,
                      clock.now_ns)
    sampler.start()
    return sampler, collectors


def thinner(rec: Recorder, opts: RecordOptions, shard_dir: str) -> Any:
    """Where the sampler's rows go: with a window or --max-size, a Thinner (full rate in
    the window, one tick a second outside it: gputrace.record.thin), else the recorder."""
    if opts.steps is None and opts.delay_s is None and opts.duration_s is None \
            and not opts.on_demand and opts.max_size is None:
        return rec
    from gputrace.record.thin import Thinner, rings
    from gputrace.recorder.ring import parse_size

    try:
        tail, kept = (None, None) if opts.max_size is None else \
            rings(shard_dir, parse_size(opts.max_size), rec.clock)
        return Thinner(rec, rec.metadata.get("window"), shard_dir, tail, kept)
    except Exception as e:  # noqa: BLE001 - sampled at full rate instead
        print(f"gputrace: samples at full rate throughout ({reason(e)})", file=sys.stderr)
        return rec


def record(opts: RecordOptions) -> RecordResult:
    """Run the job and record it. Whatever cannot be recorded (an output that cannot be
    written, a source that breaks) is said in one line; the job runs all the same and its
    exit code is the result's."""
    opts = output_of(opts)
    _check(opts)
    output = opts.output
    clock = Clock()
    shard_dir = None
    try:
        shard_dir = shards.create(output)
        rec, env = _prepare(opts, shard_dir, clock)
    except Exception as e:  # noqa: BLE001 - the job runs whenever it can
        print(f"gputrace: cannot record {output}: {reason(e)}; the job runs untraced",
              file=sys.stderr)
        if shard_dir is not None:
            shutil.rmtree(shard_dir, ignore_errors=True)
        return _run_untraced(opts)

    t0 = time.monotonic()
    fwd = Forwarder(opts.kill_after_s)
    proc = spawn(list(opts.command), env, fwd)
    if isinstance(proc, int):
        rec.close()
        shutil.rmtree(shard_dir, ignore_errors=True)
        return RecordResult(proc, None, 0.0, {})
    sampler: Sampler | None = None
    collectors: list[SystemCollector] = []
    try:
        sampler, collectors = _start_sampler(opts, rec, clock, proc.pid)
    except Exception as e:  # noqa: BLE001
        print(f"gputrace: system sampling did not start: {reason(e)}; {output} gets no "
              "host, disk or network samples", file=sys.stderr)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    listed = _listen(opts, rec, shard_dir, output)
    try:
        exit_code = wait_job(proc, fwd)
    finally:
        capture.unregister(listed)
    duration = time.monotonic() - t0
    lost = None
    try:
        top = _finish(rec, sampler, collectors, exit_code, cpu0, wall0)
        lost = rec.write_error
        from gputrace import progress
        from gputrace.record.merge import merge_shards
        from gputrace.record.place import place

        run = os.path.join(os.path.dirname(output), opts.node_of) if opts.node_of else output
        moved: list[str] = []

        def put(tmp: str, out: str, md: dict[str, Any]) -> str:
            where, why = place(tmp, out, md, force=opts.force, run=run)
            if why:
                moved.append(why)
            return where

        with progress.shown(not opts.quiet):
            res = merge_shards(shard_dir, output, top=top, place=put)
        output = res.path
        for why in moved:   # said even with -q: the file is not where it was asked for
            print(f"gputrace: {why}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - the job's exit code is the result all the same
        print(f"gputrace: could not write {output}: {lost or reason(e)}; what was recorded "
              f"until then is kept in {shard_dir} (`gputrace recover {output}` once that is "
              "fixed)", file=sys.stderr)
        return RecordResult(exit_code, None, duration, {})
    if lost:
        print(f"gputrace: {output}: the samples stop early: {lost}", file=sys.stderr)
    summary = {"rows": res.rows, "rows_by_cat": res.rows_by_cat, "shards": res.shards,
               "ranks": res.metadata.get("ranks", []), "collectors": res.metadata["collectors"],
               "warnings": res.warnings, "sampler": top.get("sampler") or {},
               "clock_warning": top.get("clock_warning"), "node_of": opts.node_of,
               "run": run if output != run else None}
    if not opts.quiet:
        print_summary(output, duration, exit_code, summary)
    if opts.max_size is not None:   # said even with -q: what is not in the trace
        from gputrace.recorder.ring import dropped_line

        line = dropped_line(output)
        if line:
            print(line, file=sys.stderr)
    return RecordResult(exit_code, output, duration, summary)


def _listen(opts: RecordOptions, rec: Recorder, shard_dir: str, output: str) -> str | None:
    """List the recording for `gputrace capture`; with a window, SIGUSR2 opens one too."""
    job = {"pid": os.getpid(), "shard_dir": shard_dir, "output": os.path.abspath(output),
           "window": _opened(rec.metadata.get("window")), "argv": list(opts.command),
           "started_ns": time.time_ns()}
    try:
        if job["window"]:
            capture.on_signal(job, opts.capture_steps)
        return capture.register(job)
    except Exception as e:  # noqa: BLE001 - the job is recorded all the same
        print(f"gputrace: `gputrace capture` cannot reach this recording: {reason(e)}",
              file=sys.stderr)
        return None


def _opened(win: Any) -> Any:
    """A window `capture` can open more of: not the one --max-size alone describes."""
    if isinstance(win, dict) and not set(win) - {"max_size", *RUN_KEYS}:
        return None
    return win


def _finish(rec: Recorder, sampler: Sampler | None, collectors: list[SystemCollector],
            exit_code: int, cpu0: float, wall0: float) -> dict[str, Any]:
    """Stop sampling, close record's own shard; the run's metadata for the merged file."""
    if sampler is not None:
        sampler.stop()
        thin = sampler.sink if sampler.sink is not rec else None
        if thin is not None:
            try:
                thin.close()
            except Exception as e:  # noqa: BLE001 - the samples held are lost, said once
                print(f"gputrace: the last samples are lost: {reason(e)}", file=sys.stderr)
        for c in collectors:
            rec.set_collector(c.name, "ok", **c.settings())
        for name, why in sampler.failed.items():
            rec.set_collector(name, why)
        rec.metadata["sampler"] = {
            "hz": sampler.hz, "achieved_hz": round(sampler.achieved_hz(), 2),
            "ticks": sampler.ticks,
            # CPU of the recording process (sampler and its writer)
            "cpu_s": round(time.process_time() - cpu0, 3),
            "wall_s": round(time.perf_counter() - wall0, 3),
            **({"thinned": thin.describe()} if thin is not None else {})}
    rec.metadata["exit_code"] = exit_code
    rec.metadata["end"] = Clock.anchor()
    step = anchors_report(rec.metadata["start"], rec.metadata["end"])
    if step:
        rec.metadata["clock_warning"] = step
    rec.close()
    return dict(rec.metadata)
