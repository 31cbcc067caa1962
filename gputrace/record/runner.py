"""Run a command under gputrace: sample it from outside, let its Python processes write shards,
forward signals, merge, and exit with the command's own code."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gputrace.clock import Clock, anchors_report
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
from gputrace.probe import embed as embed_probe
from gputrace.record import BOOTSTRAP_DIR
from gputrace.recorder import Recorder, base_metadata

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


class RecordError(Exception):
    """A problem with the request itself (exit 2, nothing was run)."""


@dataclass
class RecordOptions:
    command: list[str]
    output: str = "trace.arrow"
    hz: float = 100.0
    collectors: list[str] = field(default_factory=lambda: list(ALL_COLLECTORS))
    force: bool = False
    redact_argv: bool = False
    kill_after_s: float = 10.0
    quiet: bool = False
    gpu_timeline: str = "auto"     # auto | cupti | kineto


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


def check_output(path: str, force: bool) -> None:
    if os.path.isdir(path):
        raise RecordError(f"{path} is a directory; give a file name with -o")
    if os.path.exists(path) and not force:
        raise RecordError(f"{path} exists; use -f to overwrite it or -o to choose another name")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise RecordError(f"directory {d} does not exist")
    if not os.access(d, os.W_OK | os.X_OK):
        raise RecordError(f"directory {d} is not writable")


@contextlib.contextmanager
def _foreground(pgid: int) -> Iterator[None]:
    """Give the terminal to the child's process group (as a shell does), so Ctrl-C reaches
    the job once, directly; signals sent to `record` itself are forwarded."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR)
    except OSError:
        yield
        return
    old = None
    try:
        try:
            old = os.tcgetpgrp(fd)
            if old == os.getpgrp():
                prev = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
                try:
                    os.tcsetpgrp(fd, pgid)
                finally:
                    signal.signal(signal.SIGTTOU, prev)
            else:
                old = None
        except OSError:
            old = None
        yield
    finally:
        if old is not None:
            prev = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            try:
                os.tcsetpgrp(fd, old)
            except OSError:
                pass
            finally:
                signal.signal(signal.SIGTTOU, prev)
        os.close(fd)


class _Forwarder:
    """Forwards signals to the child's process group; a second one, or `kill_after_s`
    without an exit, escalates to SIGKILL."""

    def __init__(self, proc: subprocess.Popen[bytes], kill_after_s: float) -> None:
        self.proc = proc
        self.kill_after_s = kill_after_s
        self.received: list[int] = []
        self._timer: threading.Timer | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        for s in FORWARDED:
            self._old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        if self._timer is not None:
            self._timer.cancel()

    def _send(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self.proc.poll() is not None:
            return
        if len(self.received) > 1:
            print("gputrace: second signal; killing the job (SIGKILL)", file=sys.stderr)
            self._send(signal.SIGKILL)
            return
        self._send(signum)
        if signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            self._timer = threading.Timer(self.kill_after_s, self._escalate)
            self._timer.daemon = True
            self._timer.start()

    def _escalate(self) -> None:
        if self.proc.poll() is None:
            print(f"gputrace: the job did not exit {self.kill_after_s:g} s after the signal; "
                  "killing it (SIGKILL)", file=sys.stderr)
            self._send(signal.SIGKILL)


def record(opts: RecordOptions) -> RecordResult:
    if not opts.command:
        raise RecordError("no command given: gputrace record [options] -- CMD ...")
    bad = [c for c in opts.collectors if c not in ALL_COLLECTORS]
    if bad:
        raise RecordError(f"unknown collector(s) {', '.join(bad)}; "
                          f"choose from {', '.join(ALL_COLLECTORS)}")
    if opts.gpu_timeline not in ("auto", "cupti", "kineto"):
        raise RecordError(f"--gpu-timeline is auto, cupti or kineto, not {opts.gpu_timeline!r}")
    if not (0 < opts.hz <= 10_000):
        raise RecordError("--hz must be between 0 and 10000")
    output = opts.output
    check_output(output, opts.force)
    out_dir = os.path.dirname(os.path.abspath(output))
    shard_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.", suffix=".shards",
                                 dir=out_dir)
    clock = Clock()
    argv = list(opts.command)
    md = base_metadata("record", argv=argv, rank=-1)
    if opts.redact_argv:
        from gputrace.recorder import redact_argv
        md["argv"] = redact_argv(argv)
    md["sample_hz"] = opts.hz
    embed_probe(md)
    rec = Recorder(os.path.join(shard_dir, "record.arrow"), md, clock=clock).start()
    env = child_env(shard_dir, opts.redact_argv)
    env["GPUTRACE_GPU_TIMELINE"] = opts.gpu_timeline
    for name in IN_PROCESS_COLLECTORS:
        if name not in opts.collectors:
            env[f"GPUTRACE_NO_{name.upper()}"] = "1"
            rec.set_collector(name, "off: not in --collectors")
        else:
            rec.set_collector(name, in_process_status(name))

    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, env=env, process_group=0)
    except OSError as e:
        rec.close()
        import shutil
        shutil.rmtree(shard_dir, ignore_errors=True)
        code = 127 if isinstance(e, FileNotFoundError) else 126
        print(f"gputrace: cannot run {argv[0]}: {e.strerror or e}", file=sys.stderr)
        return RecordResult(code, None, 0.0, {})
    fwd = _Forwarder(proc, opts.kill_after_s)
    fwd.install()
    collectors: list[SystemCollector] = []
    for name in SYSTEM_COLLECTORS:
        if name not in opts.collectors:
            rec.set_collector(name, "off: not in --collectors")
            continue
        try:
            c = make_system_collector(name, proc.pid, rec.host)
        except Unavailable as e:
            rec.set_collector(name, f"unavailable: {e}")
            continue
        collectors.append(c)
    sampler = Sampler(collectors, rec, opts.hz, clock.now_ns)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sampler.start()
    try:
        with _foreground(proc.pid):
            while True:
                try:
                    rc = proc.wait()
                    break
                except KeyboardInterrupt:  # only if a handler was replaced under us
                    continue
    finally:
        fwd.restore()
    duration = time.monotonic() - t0
    sampler.stop()
    for c in collectors:
        rec.set_collector(c.name, "ok", **c.settings())
    for name, why in sampler.failed.items():
        rec.set_collector(name, why)
    exit_code = 128 - rc if rc < 0 else rc
    rec.metadata["sampler"] = {"hz": opts.hz, "achieved_hz": round(sampler.achieved_hz(), 2),
                               "ticks": sampler.ticks,
                               # CPU of the recording process (sampler and its writer)
                               "cpu_s": round(time.process_time() - cpu0, 3),
                               "wall_s": round(time.perf_counter() - wall0, 3)}
    rec.metadata["exit_code"] = exit_code
    rec.metadata["end"] = Clock.anchor()
    step = anchors_report(rec.metadata["start"], rec.metadata["end"])
    if step:
        rec.metadata["clock_warning"] = step
    rec.close()
    top = dict(rec.metadata)
    from gputrace.record.merge import merge_shards
    try:
        res = merge_shards(shard_dir, output, top=top)
    except Exception as e:
        print(f"gputrace: could not write {output}: {e}; the shards are kept in {shard_dir} "
              f"(gputrace info {shard_dir})", file=sys.stderr)
        return RecordResult(exit_code, None, duration, {})
    summary = {"rows": res.rows, "rows_by_cat": res.rows_by_cat, "shards": res.shards,
               "ranks": res.metadata.get("ranks", []), "collectors": res.metadata["collectors"],
               "warnings": res.warnings, "sampler": top["sampler"], "clock_warning": step}
    if not opts.quiet:
        print_summary(output, duration, exit_code, summary)
    return RecordResult(exit_code, output, duration, summary)


_CAT_SOURCE = {"host": "host", "cpu": "host", "disk": "host", "net": "host", "ib": "infiniband",
               "gpu": "nvml", "pcie": "nvml", "nvlink": "nvml"}


def print_summary(output: str, duration: float, exit_code: int, s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape

    con = Console(stderr=True, highlight=False, soft_wrap=True)
    size = os.path.getsize(output)
    ranks = s["ranks"]
    con.print(f"[bold]gputrace[/]: recorded {duration:.1f} s, exit code {exit_code}, "
              f"{'ranks ' + ', '.join(map(str, ranks)) if ranks else 'no ranks'}, "
              f"{s['rows']:,} rows from {s['shards']} shard{'s' if s['shards'] != 1 else ''} "
              f"-> {escape(output)} ({size / 1e6:.2f} MB)")
    rows_by_source: dict[str, int] = {}
    for cat, n in s["rows_by_cat"].items():
        src = _CAT_SOURCE.get(cat, "spans")
        rows_by_source[src] = rows_by_source.get(src, 0) + n
    for name, info in sorted(s["collectors"].items()):
        status = info.get("status", "?") if isinstance(info, dict) else str(info)
        if status == "ok":
            detail = ""
            if name == "host":
                detail = f": {rows_by_source.get('host', 0):,} samples, " \
                         f"{s['sampler']['achieved_hz']:.0f} Hz achieved"
            elif name in ("infiniband", "nvml"):
                detail = f": {rows_by_source.get(name, 0):,} samples"
            con.print(f"  {name:<11} [green]ok[/]{detail}")
        else:
            con.print(f"  {name:<11} [yellow]{escape(status)}[/]")
    con.print(f"  {'spans':<11} {rows_by_source.get('spans', 0):,} rows "
              "(phases, iterations, torch)")
    for w in s["warnings"]:
        con.print(f"[yellow]warning[/]: {escape(w)}")
    if s.get("clock_warning"):
        con.print(f"[yellow]warning[/]: {s['clock_warning']}")
    con.print(f"next: [bold]gputrace analyze {escape(output)}[/]")
