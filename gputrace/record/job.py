"""The job `record` runs: started in its own process group, given the terminal as a shell
would, `record`'s signals forwarded to it (a second one, or a stop that does not come, kills
it), and its exit code as a shell gives it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from gputrace.fmt import reason

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


@contextlib.contextmanager
def foreground(pgid: int) -> Iterator[None]:
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


class Forwarder:
    """Forwards signals to the child's process group; a second one, or `kill_after_s`
    without an exit, escalates to SIGKILL.

    Installed before the job starts: a signal that `record` catches is reset to its default
    in the job by exec, so the job starts as it would from an interactive shell. A
    non-interactive shell starts background jobs with SIGINT and SIGQUIT ignored, which the
    job would otherwise inherit and so never stop on a forwarded Ctrl-C. Other signals that
    `record` was started ignoring (SIGHUP under nohup) stay ignored, by both."""

    def __init__(self, kill_after_s: float) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.kill_after_s = kill_after_s
        self.received: list[int] = []
        self._timer: threading.Timer | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        for s in FORWARDED:
            old = signal.getsignal(s)
            if old == signal.SIG_IGN and s not in (signal.SIGINT, signal.SIGQUIT):
                continue
            self._old[s] = signal.signal(s, self._handle)

    def attach(self, proc: subprocess.Popen[bytes]) -> None:
        """The job has started: send it what arrived while it was starting."""
        self.proc = proc
        early, self.received = self.received, []
        for s in early:
            self._handle(s, None)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        if self._timer is not None:
            self._timer.cancel()

    def _send(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self.proc is None or self.proc.poll() is not None:
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
        if self.proc is not None and self.proc.poll() is None:
            print(f"gputrace: the job did not exit {self.kill_after_s:g} s after the signal; "
                  "killing it (SIGKILL)", file=sys.stderr)
            self._send(signal.SIGKILL)


def spawn(argv: list[str], env: dict[str, str], fwd: Forwarder
         ) -> subprocess.Popen[bytes] | int:
    """Start the job in its own process group with `record`'s signals forwarded to it; the
    exit code of a command that cannot run (127 not found, 126 not runnable) otherwise."""
    fwd.install()
    try:
        proc = subprocess.Popen(argv, env=env, process_group=0)
    except (OSError, ValueError) as e:
        fwd.restore()
        code = 127 if isinstance(e, FileNotFoundError) else 126
        print(f"gputrace: cannot run {argv[0]}: {reason(e)}", file=sys.stderr)
        return code
    fwd.attach(proc)
    return proc


def wait_job(proc: subprocess.Popen[bytes], fwd: Forwarder) -> int:
    """The job's exit code as a shell gives it (128 + signal when a signal ended it)."""
    try:
        with foreground(proc.pid):
            while True:
                try:
                    rc = proc.wait()
                    break
                except KeyboardInterrupt:  # only if a handler was replaced under us
                    continue
    finally:
        fwd.restore()
    return 128 - rc if rc < 0 else rc
