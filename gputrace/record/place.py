"""Where a finished recording's file goes: the path asked for, created atomically (written
under a temporary name, then linked into place, which fails rather than replace a file), and
never over a file another recording wrote. Where that path is taken, the file goes beside it
as `run.HOST.arrow` (`run.HOST.PID.arrow` when that host's name does not tell the two apart),
naming `run.arrow` as what it is a part of, so that `gputrace analyze run.arrow` reads both.

`-f` replaces only a file of an earlier recording: never one whose recording ran at the same
moment as this one (its metadata's start and end anchors say when it ran)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid
from collections.abc import Iterator
from typing import Any

from gputrace.trace.parts import metadata_of as metadata
from gputrace.trace.parts import same_moment

# link() refused for what the file system is, not for what is in the directory
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK,
             errno.ENOSYS}


def temporary(out: str) -> str:
    """A name beside `out` that no other recording, on any host, writes to."""
    d, base = os.path.split(os.path.abspath(out))
    return os.path.join(d, f".{base}.{uuid.uuid4().hex}.tmp")


def _safe(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in host) or "host"


def beside(run: str, host: str, pid: int, with_pid: bool) -> Iterator[str]:
    """The names a part of `run` may take beside it, in order of preference."""
    stem, ext = os.path.splitext(run)
    ext = ext or ".arrow"
    h = _safe(host)
    if not with_pid:
        yield f"{stem}.{h}{ext}"
    yield f"{stem}.{h}.{pid}{ext}"
    for k in range(2, 1000):
        yield f"{stem}.{h}.{pid}-{k}{ext}"


def _link(tmp: str, dst: str) -> bool:
    """Put `tmp` at `dst` unless something is there already (False then)."""
    try:
        os.link(tmp, dst)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        # no hard links here: claim the name first, then move the file onto the claim
        try:
            os.close(os.open(dst, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        os.replace(tmp, dst)
        return True
    os.unlink(tmp)
    return True


@contextlib.contextmanager
def _locked(out: str) -> Iterator[None]:
    """Held while a forced recording decides whether it may replace `out` (a POSIX lock,
    which network file systems pass on to the server)."""
    d, base = os.path.split(os.path.abspath(out))
    try:
        fd = os.open(os.path.join(d, f".{base}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def place(tmp: str, out: str, md: dict[str, Any], force: bool = False,
          run: str | None = None) -> tuple[str, str | None]:
    """Move the finished file `tmp` to `out`, or beside it where `out` is taken; returns the
    path it is at and, when that is not `out`, the line saying why. `md` is this recording's
    metadata (host, start and end); `run` the name the parts are found from (`out`)."""
    try:
        if _link(tmp, out):
            return out, None
        if force:
            with _locked(out):
                if not same_moment(metadata(out), md):
                    os.replace(tmp, out)
                    return out, None
        other = metadata(out) or {}
        host = str(md.get("host") or "")
        with_pid = (run or out) != out or other.get("host") == host
        for name in beside(run or out, host, os.getpid(), with_pid):
            if name != out and _link(tmp, name):
                who = other.get("host")
                by = f" by another recording{f' on {who}' if who else ''}"
                return name, (f"{out} was written{by} meanwhile; this recording is in "
                              f"{name} beside it (`gputrace analyze {run or out}` reads both)")
        raise FileExistsError(errno.EEXIST, f"no free name beside {out}")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
