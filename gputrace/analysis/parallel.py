"""Where per-rank analysis runs: worker processes on this machine, or an existing cluster
engine (Dask distributed, Ray) whose workers read the trace files from a shared filesystem.
Each is a `concurrent.futures.Executor`; nothing here schedules work of its own."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import Any


class EngineError(Exception):
    """An engine that cannot be used (not installed, not reachable): one line for the user."""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _worker_init() -> None:
    import pyarrow as pa

    # as the command line does: freed columns go back to the OS at once
    pa.set_memory_pool(pa.system_memory_pool())


def process_pool(jobs: int) -> ProcessPoolExecutor:
    """`jobs` worker processes, forked from a server that has the analysis loaded (not from
    this process, whose Arrow threads a fork would copy mid-flight)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["gputrace.analyzers"])
    return ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init)


@contextlib.contextmanager
def dask_executor(address: str, timeout_s: float = 20) -> Iterator[Executor]:
    """The concurrent.futures executor of a Dask distributed cluster's client."""
    try:
        from distributed import Client
    except ImportError:
        raise EngineError("--dask needs Dask distributed: pip install 'gputrace[cluster]'") \
            from None
    _reachable(address, timeout_s)
    try:
        client = Client(address, timeout=timeout_s, set_as_default=False)
    except (OSError, TimeoutError, ValueError, TypeError) as e:
        raise EngineError(f"cannot reach the Dask scheduler at {address}: {e}") from None
    try:
        yield client.get_executor(pure=False)
    finally:
        client.close()


def _reachable(address: str, timeout_s: float) -> None:
    """Refuse an address that is malformed or where nothing listens, before a Client is
    made (one that never connects lingers, and complains as the interpreter exits)."""
    import socket

    from distributed.comm import parse_address, parse_host_port

    try:
        scheme, loc = parse_address(address)
        if scheme not in ("tcp", "tls"):
            return
        host, port = parse_host_port(loc)
        if not host or not port:
            raise ValueError("give HOST:PORT")
    except (ValueError, TypeError) as e:
        raise EngineError(f"--dask {address!r} is not a scheduler address like "
                          f"tcp://HOST:8786 ({e})") from None
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise EngineError(f"cannot reach the Dask scheduler at {address}: "
                          f"{e.strerror or e}") from None


class _RayExecutor(Executor):
    """Ray tasks behind the Executor interface (each call one remote task)."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray
        self._remote: dict[Callable[..., Any], Any] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(fn)
        return remote.remote(*args, **kwargs).future()

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any],
            timeout: float | None = None, chunksize: int = 1) -> Iterator[Any]:
        futures = [self.submit(fn, *args) for args in zip(*iterables, strict=True)]
        return (f.result(timeout) for f in futures)


@contextlib.contextmanager
def ray_executor(address: str) -> Iterator[Executor]:
    """Ray tasks on the cluster at `address` ('auto': the one this machine belongs to)."""
    try:
        import ray
    except ImportError:
        raise EngineError("--ray needs Ray: pip install 'gputrace[ray]'") from None
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    except (ConnectionError, ValueError, RuntimeError, OSError) as e:
        raise EngineError(f"cannot connect to the Ray cluster at {address}: {e}") from None
    try:
        yield _RayExecutor(ray)
    finally:
        ray.shutdown()


@contextlib.contextmanager
def executor(jobs: int, dask: str | None = None, ray: str | None = None
             ) -> Iterator[Executor | None]:
    """The executor the options ask for (None: analyze in this process)."""
    if dask is not None:
        with dask_executor(dask) as ex:
            yield ex
    elif ray is not None:
        with ray_executor(ray) as ex:
            yield ex
    elif jobs > 1:
        with process_pool(jobs) as ex:
            yield ex
    else:
        yield None
