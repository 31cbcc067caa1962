"""Windows opened on demand: `gputrace capture [PID|--all] --steps N` from another shell, or
SIGUSR2 to `gputrace record`, opens a window of N iterations in a job recording with
`--on-demand` (or `--steps`, `--delay`), on every process of it at the same iteration.

The processes agree through files in the recording's shard directory:

1. the requester writes `capture.json` ({"id", "count", "asked_ns"}, no "start");
2. each process's window reads it at its next flush (within a second), answers with
   `capture-ID-PID.json` (its current step) and from then on holds the iterations after
   that step undecided, their detail kept;
3. once every process writing a shard answered (or ANSWER_WAIT_S passed), the requester
   rewrites `capture.json` with "start": the highest step answered plus one. Every process
   still holds that step, so each opens the window there: the same iteration everywhere, the
   one after the most advanced process's when it was asked. Each says it did
   (`capture-ID-PID.opened`); the requester waits for that before it returns, so a request
   that follows never overwrites a start not yet read. Requesters take turns (a lock).

A process that never sees the start (the requester died) lets its iterations go after
HOLD_S. Running recordings are listed in a directory of this user's (registry_dir()).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

REQUEST = "capture.json"
ANSWER_WAIT_S = 10.0   # a process answers at its next flush (< 1 s), later on a loaded host
HOLD_S = 30.0          # longer than a request waits for answers, with room
SIGNAL = signal.SIGUSR2


class CaptureError(Exception):
    """A capture that cannot be made: said as one line."""


def registry_dir() -> str:
    return os.environ.get("GPUTRACE_RUN_DIR") or os.path.join(
        tempfile.gettempdir(), f"gputrace-{os.getuid()}")


def _write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            v = json.load(f)
    except (OSError, ValueError):
        return None
    return v if isinstance(v, dict) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the recordings running on this host ----------------------------------------------------
def register(job: dict[str, Any]) -> str | None:
    """List a running recording (its `pid`, `shard_dir`, `output`, `window`); the file to
    remove when it ends, None where it cannot be listed (capture then cannot find it)."""
    try:
        d = registry_dir()
        os.makedirs(d, mode=0o700, exist_ok=True)
        path = os.path.join(d, f"{job['pid']}.json")
        _write_json(path, job)
        return path
    except OSError:
        return None


def unregister(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


def jobs() -> list[dict[str, Any]]:
    """The recordings running on this host, oldest first (those whose `record` is gone are
    forgotten)."""
    d = registry_dir()
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    out = []
    for n in names:
        if not n.endswith(".json"):
            continue
        job = _read_json(os.path.join(d, n))
        if job is None or not isinstance(job.get("pid"), int):
            continue
        if not _alive(job["pid"]) or not os.path.isdir(str(job.get("shard_dir"))):
            unregister(os.path.join(d, n))
            continue
        out.append(job)
    return sorted(out, key=lambda j: j.get("started_ns", 0))


def _writers(shard_dir: str) -> set[int]:
    """The live processes writing a shard of the job (`HOST-PID-N.spans`), record's own
    left out."""
    pids = set()
    with contextlib.suppress(OSError):
        for n in os.listdir(shard_dir):
            parts = n.rsplit("-", 2)
            if len(parts) == 3 and parts[1].isdigit() and _alive(int(parts[1])):
                pids.add(int(parts[1]))
    return pids


def find(pid: int) -> dict[str, Any]:
    """The running recording `pid` belongs to: its `gputrace record`, or a process of the
    job writing a shard of it."""
    listed = jobs()
    for job in listed:
        if job["pid"] == pid:
            return job
    for job in listed:
        if pid in _writers(job["shard_dir"]):
            return job
    if not _alive(pid):
        raise CaptureError(f"no process {pid} on this host")
    raise CaptureError(f"process {pid} is not recorded by a gputrace record running on this "
                       f"host ({len(listed)} recording(s) found)")


# -- the requester ----------------------------------------------------------------------------
def request(job: dict[str, Any], count: int, wait_s: float = ANSWER_WAIT_S
            ) -> dict[str, Any]:
    """Open a window of `count` iterations in `job`: where it opened and who answered."""
    if not job.get("window"):
        raise CaptureError(f"{job.get('output')} (record pid {job['pid']}) records every "
                           "iteration in full already: record with --on-demand to open "
                           "windows when asked")
    d = job["shard_dir"]
    try:
        lock = os.open(os.path.join(d, "capture.lock"), os.O_CREAT | os.O_RDWR, 0o600)
    except OSError as e:
        raise CaptureError(f"cannot ask {job.get('output')}: {e.strerror or e}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _request(job, d, count, wait_s)
    finally:
        os.close(lock)


def _answers(d: str, ident: str, suffix: str) -> dict[int, dict[str, Any]]:
    out = {}
    with contextlib.suppress(OSError):
        for n in os.listdir(d):
            if n.startswith(f"capture-{ident}-") and n.endswith(suffix):
                a = _read_json(os.path.join(d, n))
                if a is not None and isinstance(a.get("step"), int):
                    out[int(a.get("pid", -1))] = a
    return out


def _request(job: dict[str, Any], d: str, count: int, wait_s: float) -> dict[str, Any]:
    ident = f"{time.time_ns():x}"
    asked = {"id": ident, "count": int(count), "asked_ns": time.time_ns()}
    try:
        _write_json(os.path.join(d, REQUEST), asked)
    except OSError as e:
        raise CaptureError(f"cannot ask {job.get('output')}: {e.strerror or e}") from None
    deadline = time.monotonic() + wait_s
    while True:
        answers = _answers(d, ident, ".json")
        waiting = _writers(d) - set(answers)
        if (answers and not waiting) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if not answers:
        raise CaptureError(f"no process of {job.get('output')} answered within {wait_s:g} s "
                           "(has the job started its training loop?)")
    start = max(a["step"] for a in answers.values()) + 1
    try:
        _write_json(os.path.join(d, REQUEST), {**asked, "start": start})
    except OSError as e:
        raise CaptureError(f"cannot tell {job.get('output')} where: {e.strerror or e}") \
            from None
    deadline = time.monotonic() + wait_s
    while True:
        opened = _answers(d, ident, ".opened")
        if set(answers) <= set(opened) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if not opened:      # told where, none said it opened: nothing is known to be open
        why = ("the job has ended" if not _alive(job["pid"]) else
               "its processes may be ending, or too busy to flush")
        raise CaptureError(
            f"{len(answers)} process{'' if len(answers) == 1 else 'es'} of "
            f"{job.get('output')} answered, but none confirmed the window from step {start} "
            f"within {wait_s:g} s ({why}): no window is known to be open")
    ranks = sorted({a["rank"] for a in opened.values() if a.get("rank", -1) >= 0})
    waiting = sorted(set(waiting) | (set(answers) - set(opened)))
    return {"output": job.get("output"), "record_pid": job["pid"], "start": start,
            "count": int(count), "processes": len(opened), "ranks": ranks,
            "steps": {str(a["rank"]): a["step"] for a in answers.values()
                      if a.get("rank", -1) >= 0},
            "unanswered": sorted(waiting)}


def on_signal(job: dict[str, Any], count: int) -> None:
    """Make SIGSIGNAL to this process (`record`) open a window of `count` iterations."""
    def asked(signum: int, frame: Any) -> None:
        def run() -> None:
            try:
                r = request(job, count)
                print(f"gputrace: {describe(r)}", file=sys.stderr)
            except CaptureError as e:
                print(f"gputrace: no window opened: {e}", file=sys.stderr)
        threading.Thread(target=run, name="gputrace-capture", daemon=True).start()

    signal.signal(SIGNAL, asked)


def describe(r: dict[str, Any]) -> str:
    from gputrace.fmt import count

    n = r["processes"]
    who = count(len(r["ranks"]), "rank") if r["ranks"] else \
        f"{n} process{'' if n == 1 else 'es'}"
    line = (f"window of {count(r['count'], 'iteration')} from step {r['start']} on {who} of "
            f"{r['output']} (record pid {r['record_pid']})")
    if r["unanswered"]:
        line += (f"; {'process' if len(r['unanswered']) == 1 else 'processes'} "
                 f"{', '.join(map(str, r['unanswered']))} did not answer")
    return line


# -- the job's side ---------------------------------------------------------------------------
class Answer:
    """A process's side: read at each flush whether a window is asked for, answer, hold the
    iterations after the step answered until told where the window starts."""

    def __init__(self, shard_dir: str, rec: Any) -> None:
        self.dir, self.rec = shard_dir, rec
        self.path = os.path.join(shard_dir, REQUEST)
        self.held: list[Any] | None = None      # [step answered, iteration spans, since]
        self._answered: set[str] = set()
        self._opened: set[str] = set()

    @classmethod
    def of(cls, rec: Any) -> Answer | None:
        d = os.environ.get("GPUTRACE_SHARD_DIR")
        return cls(d, rec) if d and os.path.isdir(d) else None

    def fresh(self) -> Answer:
        return Answer(self.dir, self.rec)

    def _release(self) -> list[Any]:
        held, self.held = self.held, None
        return held[1] if held else []

    def poll(self, window: Any, closing: bool, spans: list[Any]) -> list[Any]:
        """The iteration spans it held, once they may be decided (else none); `spans`: this
        flush's, on the trace clock (realtime ns)."""
        req = _read_json(self.path) if os.path.exists(self.path) else None
        ident = str(req.get("id")) if req else None
        if req is None or ident in self._opened:
            pass
        elif req.get("start") is not None:
            start, count = int(req["start"]), int(req.get("count") or 0)
            if count > 0:
                window.open(start, count)
                self.rec.row("instant", "window", "capture", self.rec.now_ns(), step=start,
                             args=json.dumps({"id": ident, "count": count,
                                              "asked_ns": req.get("asked_ns")}))
            self._opened.add(ident)
            with contextlib.suppress(OSError):
                _write_json(os.path.join(self.dir, f"capture-{ident}-{os.getpid()}.opened"),
                            {"pid": os.getpid(), "rank": int(self.rec.rank), "step": start})
            return self._release()
        elif ident not in self._answered:
            self._answered.add(ident)
            step = self._step_at(req.get("asked_ns"), spans, window.last_decided)
            with contextlib.suppress(OSError):
                _write_json(os.path.join(self.dir, f"capture-{ident}-{os.getpid()}.json"),
                            {"pid": os.getpid(), "rank": int(self.rec.rank), "step": step})
                self.held = [step, [], time.monotonic()]
        if self.held is not None and (closing or time.monotonic() - self.held[2] > HOLD_S):
            return self._release()
        return []

    def _step_at(self, asked: Any, spans: list[Any], decided: int) -> int:
        """The iteration this process was in when asked: the first of this flush's that
        ended after then, else the one it is in now; never one already decided."""
        k = int(self.rec.step)
        if isinstance(asked, int):
            after = [sp[5] for sp in spans if sp[0] == "iteration" and sp[5] is not None
                     and sp[3] > asked]
            if after:
                k = min(after)
        return max(k, decided)
