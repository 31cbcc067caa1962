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

    from gputrace.analysis import nopandas

    # a worker runs gputrace's analysis only: without pandas, as the command (unless the
    # script that started the pool imported it, as its `__mp_main__` again here)
    nopandas.block()
    # as the command line does: freed columns go back to the OS at once
    pa.set_memory_pool(pa.system_memory_pool())


def process_pool(jobs: int) -> ProcessPoolExecutor:
    """`jobs` worker processes, started fresh (not forked from this process, whose Arrow
    threads a fork would copy mid-flight); each imports the analysis it is handed. As with
    any process pool that does not fork, a script that starts one runs again as the workers'
    `__mp_main__`: the `if __name__ == "__main__":` idiom (docs/python.md)."""
    import multiprocessing

    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init)


class WithCaller(Executor):
    """A pool of `workers` processes and the calling process at work together (`--jobs N`:
    N - 1 workers): the caller takes tasks of each `map` itself whenever the next result in
    order is not in yet, rather than idling in the wait; a worker fewer (see bench/README.md,
    "Many ranks").
    Results come in order, as `Executor.map`'s; a task's error is raised where its result
    would have come."""

    def __init__(self, pool: Executor, workers: int) -> None:
        self._pool = pool
        self._ahead = max(2 * workers, 1)   # tasks handed out beyond the one awaited

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._pool.submit(fn, *args, **kwargs)

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any],
            timeout: float | None = None, chunksize: int = 1) -> Iterator[Any]:
        tasks = list(zip(*iterables, strict=True))
        return self._ordered(fn, tasks)

    def _ordered(self, fn: Callable[..., Any], tasks: list[tuple[Any, ...]]) -> Iterator[Any]:
        pending: dict[int, Future[Any]] = {}
        here: dict[int, tuple[bool, Any]] = {}   # done in this process: (ok, result or error)
        nxt = 0      # the first task not yet handed out
        try:
            for i in range(len(tasks)):
                while i not in here:
                    while nxt < len(tasks) and len(pending) < self._ahead:
                        pending[nxt] = self._pool.submit(fn, *tasks[nxt])
                        nxt += 1
                    f = pending[i]    # handed out in order: i is out, here or in a worker
                    if f.done() or nxt >= len(tasks):
                        del pending[i]
                        yield f.result()
                        break
                    j, nxt = nxt, nxt + 1          # the next unsent, done here meanwhile
                    try:
                        here[j] = (True, fn(*tasks[j]))
                    except Exception as e:   # raised in its turn, as map does
                        here[j] = (False, e)
                else:
                    ok, res = here.pop(i)
                    if not ok:
                        raise res
                    yield res
        finally:
            for f in pending.values():
                f.cancel()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


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
    """The executor the options ask for (None: analyze in this process; `jobs` processes:
    this one and `jobs - 1` workers)."""
    if dask is not None:
        with dask_executor(dask) as ex:
            yield ex
    elif ray is not None:
        with ray_executor(ray) as ex:
            yield ex
    elif jobs > 1:
        with process_pool(jobs - 1) as pool:
            yield WithCaller(pool, jobs - 1)
    else:
        yield None
