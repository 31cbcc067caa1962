"""The completion of a CPU backend's collective (gloo, MPI), seen on gputrace's own threads.

A Python callback on the future of such a collective (`then`, `add_done_callback`) runs on
the backend's C++ thread, which enters Python through `PyGILState_Ensure`: a new Python
thread state each time, made under the interpreter's head lock without holding the GIL, and
once more when torch drops a `then` callback, after the future the job waits on completed.
A `fork()` by the job at that moment (a DataLoader starting its workers after a step) leaves
the child that lock held: before CPython 3.11.10 and 3.12.1 the child hangs in
`PyOS_AfterFork_Child` (python/cpython#112275) and the job waits on it for ever. Measured on
DDP over gloo forking after each step: 15 of 2,000 children hung under the `then` callback,
none without it.

So such futures are waited on here, by threads Python started (their thread states are made
by their starter, which holds the GIL, as a fork does): one per future in flight, each kept
for the next. A CUDA future (NCCL) keeps its callback: it completes on the thread that issued
it, and a wait on another thread would make that thread's stream wait for it.

A CPU collective issued inside a backward (DDP's buckets, a hook's all-reduce) is issued
under `issuing()`: torch (2.13) keeps a Python object (the backward's
`contextvars` context) in the thread-local state each collective's Work copies, and gloo's
thread frees a completed Work itself, taking the GIL to drop that object. When the job's
last step ends the process within a few milliseconds, that happens during the
interpreter's finalization, which ends the thread through a C++ destructor: the process
aborts (SIGABRT, "terminate called without an active exception"), a plain torchrun of DDP
over gloo 5 times in 27 here. Issued without the object, the Work needs no GIL to be freed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from gputrace.collectors.torch.guard import _hook_failed

MAX_THREADS = 64     # futures in flight beyond it: their callbacks run where torch runs them


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[queue.SimpleQueue[Any]] = []
        self.threads = 0

    def submit(self, fut: Any, done: Callable[[Any], None]) -> bool:
        """`done(fut)` on a waiter once `fut` completed (failed too); False where no waiter
        could take it (the caller adds its callback as before)."""
        with self.lock:
            q = self.idle.pop() if self.idle else None
            if q is None:
                if self.threads >= MAX_THREADS:
                    return False
                self.threads += 1
        if q is None:
            q = queue.SimpleQueue()
            try:
                threading.Thread(target=self._run, args=(q,), name="gputrace-wait",
                                 daemon=True).start()
            except Exception:  # noqa: BLE001 - no thread: the callback as before
                with self.lock:
                    self.threads -= 1
                return False
        q.put((fut, done))
        return True

    def _run(self, q: queue.SimpleQueue[Any]) -> None:
        while True:
            fut, done = q.get()
            try:
                fut.wait()
            except Exception:  # noqa: BLE001 - failed: `done` sees it in the future
                pass
            try:
                done(fut)
            except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
                _hook_failed("a collective's completion", e)
            del fut, done
            with self.lock:
                self.idle.append(q)


_pool = _Pool()


def _forked() -> None:
    global _pool
    _pool = _Pool()      # the parent's waiters are not in the child


os.register_at_fork(after_in_child=_forked)


def on_cpu(tensor: Any) -> bool:
    """Whether a collective on `tensor` completes on a CPU backend's thread."""
    return getattr(getattr(tensor, "device", None), "type", None) == "cpu"


def when_done(fut: Any, done: Callable[[Any], None]) -> None:
    """`done(fut)` once the CPU collective's future `fut` completed, on a waiter."""
    if not _pool.submit(fut, done):
        fut.add_done_callback(done)


_TLS_KEY = "context"   # what torch.autograd.graph._engine_run_backward stashes
_AS_IS = contextlib.nullcontext()


def _in_backward_context() -> bool:
    """Whether this thread's torch state holds the backward's stashed context."""
    try:
        import torch

        return bool(torch._C._is_key_in_tls(_TLS_KEY))
    except Exception:  # noqa: BLE001 - a torch without it stashes nothing
        return False


def issuing(on_cpu: Callable[[], bool]) -> contextlib.AbstractContextManager[None]:
    """What a collective about to be issued runs in: outside the backward's context where
    it is inside a backward and `on_cpu()` (the module's docstring), else as it is."""
    if _in_backward_context() and on_cpu():
        return _outside_backward_context()
    return _AS_IS


@contextlib.contextmanager
def _outside_backward_context() -> Iterator[None]:
    """The backward's stashed `contextvars` context out of this thread's torch state for
    the call, put back after it."""
    import torch

    c = torch._C
    held = None
    try:
        held = c._get_obj_in_tls(_TLS_KEY)
        c._remove_obj_from_tls(_TLS_KEY)
    except Exception as e:  # noqa: BLE001 - issued as the job would have
        held = None
        _hook_failed("the backward's thread-local context", e)
    try:
        yield
    finally:
        if held is not None:
            try:
                c._stash_obj_in_tls(_TLS_KEY, held)
            except Exception as e:  # noqa: BLE001
                _hook_failed("the backward's thread-local context", e)
