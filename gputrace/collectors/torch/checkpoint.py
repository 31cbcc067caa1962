"""Checkpoints on the recorder: `torch.save` and `torch.load`, and torch.distributed.
checkpoint's `save`, `async_save` and `load`, each a `checkpoint` span (step -1: no part of
an iteration; a training iteration whose step ran before it ends where it begins) with the
bytes it wrote or read where known. `async_save`'s blocking part (the call) and its
background part (from the call's return to its future's completion) are two spans, the
second with `args.background`. Only the outermost call is recorded (DCP's writer calls
`torch.save` inside its own)."""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from gputrace.collectors.torch import lazy
from gputrace.collectors.torch.guard import _guarded

SAVER = "torch.distributed.checkpoint.state_dict_saver"
LOADER = "torch.distributed.checkpoint.state_dict_loader"
PACKAGE = "torch.distributed.checkpoint"

_depth = threading.local()
# the threads whose async saves are in flight (ident -> count): a save on another thread
# meanwhile is the background part of one of them (async_save runs save in its executor)
_async_callers: dict[int, int] = {}


def _size(f: Any) -> int | None:
    """The size of a file named by `f` (a path), None where `f` is no path."""
    if isinstance(f, (str, os.PathLike)):
        try:
            return os.path.getsize(f)
        except OSError:
            return None
    return None


def _rank_bytes(metadata: Any) -> int | None:
    """The bytes this rank's files hold in a DCP checkpoint's metadata (its items' lengths
    in the files named `__<rank>_*`), None where the metadata does not say."""
    data = getattr(metadata, "storage_data", None)
    if not isinstance(data, dict):
        return None
    rank = 0
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
    except Exception:  # noqa: BLE001 - no process group: one process, rank 0
        rank = 0
    mine = [getattr(v, "length", None) for v in data.values()
            if str(getattr(v, "relative_path", "")).startswith(f"__{rank}_")]
    return int(sum(x for x in mine if x is not None)) if mine else None


def inner_bytes(*_: Any) -> int | None:
    """The bytes the torch.save calls inside the outermost checkpoint call wrote to files
    (on its thread), None where none did: a framework's save made of them."""
    return getattr(_depth, "inner", 0) or None


@_guarded
def _count_inner(nbytes: Any, args: Any, kwargs: Any, out: Any) -> None:
    n = nbytes(args, kwargs, out, None)
    if n:
        _depth.inner = getattr(_depth, "inner", 0) + int(n)


def _wrap(get_state: Any, name: str, op: str, fn: Any, nbytes: Any,
          before_fn: Any = None) -> Any:
    """fn timed as a `checkpoint` span named `name`; nbytes(args, kwargs, result, before)
    gives its bytes (None: unknown); `before` is before_fn(args, kwargs) where given (what
    the call's bytes are counted against), else a file object's position."""
    if getattr(fn, "_gputrace", False):
        return fn

    @_guarded
    def begin(args: Any, kwargs: Any) -> tuple[int, int | None]:
        st = get_state()
        t0 = st.now()
        st.its.aside(t0)
        f = args[1] if op == "save" and len(args) > 1 else kwargs.get("f")
        before = None
        if before_fn is not None:
            before = before_fn(args, kwargs)
        elif f is not None and hasattr(f, "tell") and hasattr(f, "write"):
            before = f.tell()
        return t0, before

    @_guarded
    def end(t0: int, args: Any, kwargs: Any, out: Any, before: Any) -> None:
        st = get_state()
        st.rec.span("checkpoint", name, t0, st.now(), step=-1,
                    nbytes=nbytes(args, kwargs, out, before), args={"op": op})

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nested = getattr(_depth, "n", 0)
        if get_state() is None or nested or (
                _async_callers and threading.get_ident() not in _async_callers):
            out = fn(*args, **kwargs)
            if nested and name == "torch.save" and get_state() is not None:
                _count_inner(nbytes, args, kwargs, out)
            return out
        got = begin(args, kwargs)
        _depth.n, _depth.inner = 1, 0
        try:
            out = fn(*args, **kwargs)
        finally:
            _depth.n = 0
        if got is not None:
            end(got[0], args, kwargs, out, got[1])
        return out

    wrapper._gputrace = True  # type: ignore[attr-defined]
    return wrapper


def _torch_bytes(op: str) -> Any:
    def nbytes(args: Any, kwargs: Any, out: Any, before: Any) -> int | None:
        f = (args[1] if op == "save" else args[0]) if len(args) > (op == "save") \
            else kwargs.get("f")
        if before is not None and f is not None:
            return max(int(f.tell()) - int(before), 0)
        return _size(f)
    return nbytes


def _dcp_path_bytes(args: Any, kwargs: Any, out: Any, before: Any) -> int | None:
    return _rank_bytes(out)      # save returns the checkpoint's metadata


def _async(get_state: Any, fn: Any) -> Any:
    """async_save: its call (blocking) and, on another span, its background part until
    the future it returns completes (the upload's, where it returns both)."""
    if getattr(fn, "_gputrace", False):
        return fn

    def settle(me: int) -> None:
        n = _async_callers.get(me, 0) - 1
        if n > 0:
            _async_callers[me] = n
        else:
            _async_callers.pop(me, None)

    @_guarded
    def begin() -> int:
        st = get_state()
        t0 = st.now()
        st.its.aside(t0)
        # from the call on: its executor may start the save before the call returns
        me = threading.get_ident()
        _async_callers[me] = _async_callers.get(me, 0) + 1
        return t0

    @_guarded
    def returned(t0: int, out: Any) -> None:
        st = get_state()
        t1 = st.now()
        st.rec.span("checkpoint", "dcp.async_save", t0, t1, step=-1,
                    args={"op": "save", "background": False})
        fut = getattr(out, "upload_completion", out)
        me = threading.get_ident()
        if not hasattr(fut, "add_done_callback"):
            settle(me)
            return
        rec = st.rec

        def done(f: Any) -> None:
            settle(me)
            try:
                res = f.result() if not f.exception() else None
                rec.span("checkpoint", "dcp.async_save (background)", t1, rec.clock.now_ns(),
                         step=-1, nbytes=_rank_bytes(res),
                         args={"op": "save", "background": True})
            except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
                from gputrace.collectors.torch.guard import _hook_failed

                _hook_failed("async_save done", e)

        fut.add_done_callback(done)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if get_state() is None or getattr(_depth, "n", 0):
            return fn(*args, **kwargs)
        t0 = begin()
        _depth.n = 1
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            if t0 is not None:
                settle(threading.get_ident())
            raise
        finally:
            _depth.n = 0
        if t0 is not None:
            returned(t0, out)
        return out

    wrapper._gputrace = True  # type: ignore[attr-defined]
    return wrapper


def install(get_state: Any) -> None:
    """torch.save / torch.load now; DCP's save, async_save and load when imported."""
    import torch
    import torch.serialization as ser

    save = _wrap(get_state, "torch.save", "save", torch.save, _torch_bytes("save"))
    load = _wrap(get_state, "torch.load", "load", torch.load, _torch_bytes("load"))
    torch.save = ser.save = save
    torch.load = ser.load = load

    def patch_saver(m: Any) -> None:
        m.save = _wrap(get_state, "dcp.save", "save", m.save, _dcp_path_bytes)
        m.async_save = _async(get_state, m.async_save)
        pkg = __import__("sys").modules.get(PACKAGE)
        if pkg is not None:     # imported before: its names are bound already
            pkg.save, pkg.async_save = m.save, m.async_save

    def patch_loader(m: Any) -> None:
        m.load = _wrap(get_state, "dcp.load", "load", m.load, lambda *a: None)
        pkg = __import__("sys").modules.get(PACKAGE)
        if pkg is not None and hasattr(pkg, "load"):
            pkg.load = m.load

    lazy.when_imported(SAVER, patch_saver, "distributed checkpoint save")
    lazy.when_imported(LOADER, patch_loader, "distributed checkpoint load")
