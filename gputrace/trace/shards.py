"""Where a recording keeps its shards until it is closed: a hidden directory beside the trace
it becomes (`.run.arrow.XXXXXXXX.shards/`), so that a recording killed before it could merge
them is found again from the path the user named.

Every process writing into the directory holds a shared lock on it for as long as it runs
(the kernel lets go of it when the process dies, kill -9 included): a directory nobody
holds is a recording that was not closed, and only such a one is finalized by `recover`."""

from __future__ import annotations

import fcntl
import os
import tempfile

SUFFIX = ".shards"
_RANDOM = 8          # characters mkdtemp puts between prefix and suffix


def _prefix(path: str) -> str:
    return f".{os.path.basename(path)}."


def create(path: str) -> str:
    """A new shard directory for the trace `path` (OSError, saying where, when it cannot be
    made)."""
    where = os.path.dirname(os.path.abspath(path))
    try:
        return tempfile.mkdtemp(prefix=_prefix(path), suffix=SUFFIX, dir=where)
    except OSError as e:
        raise OSError(e.errno, f"cannot create files in {where} ({e.strerror})") from None


def find(path: str) -> list[str]:
    """The shard directories of recordings of `path` that were never merged, newest first."""
    prefix = _prefix(os.path.normpath(path))
    d = os.path.dirname(os.path.abspath(path))
    try:
        names = os.listdir(d)
    except OSError:
        return []
    found = [os.path.join(d, n) for n in names
             if n.startswith(prefix) and n.endswith(SUFFIX)
             and len(n) == len(prefix) + _RANDOM + len(SUFFIX)]
    found = [f for f in found if os.path.isdir(f)]
    return sorted(found, key=_mtime, reverse=True)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _lock(directory: str, how: int) -> int | None:
    """The directory opened and flock'ed without waiting (the descriptor), or None."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def hold(directory: str) -> int | None:
    """Hold a shared lock on `directory` while writing into it; returns the descriptor to
    close when done (None where the directory cannot be locked)."""
    return _lock(directory, fcntl.LOCK_SH)


def take(directory: str) -> int | None:
    """An exclusive lock on a shard directory nobody writes into any more (the descriptor,
    to close when done), or None while some process still records into it."""
    return _lock(directory, fcntl.LOCK_EX)


def in_use(directory: str) -> bool:
    """Whether some process is still recording into `directory`."""
    fd = take(directory)
    if fd is None:
        return os.path.isdir(directory)
    os.close(fd)
    return False
