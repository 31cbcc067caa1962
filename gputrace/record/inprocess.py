"""The in-process side of `record`: one shard per process, forks included, and the hooks that
instrument torch, tensorflow and keras when (and only when) the job imports them."""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import itertools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from gputrace.metadata import base_metadata, hostname
from gputrace.recorder import core as _recorder
from gputrace.trace import frames

_counter = itertools.count()
_shard_dir = ""
_mp_registered = False


def shard_path(shard_dir: str) -> str:
    host = hostname().replace("/", "_")
    return os.path.join(shard_dir, f"{host}-{os.getpid()}-{next(_counter)}{frames.SUFFIX}")


def _window(rec: _recorder.Recorder) -> None:
    """The window `record --steps/--delay/--duration` asked for, if any."""
    try:
        from gputrace import window

        w = window.from_env()
        if w is not None:
            w.attach(rec)
    except Exception as e:  # noqa: BLE001 - recorded in full instead
        print(f"gputrace: no recording window ({type(e).__name__}: {e}); recording every "
              "iteration in full", file=sys.stderr)


def _max_size(rec: _recorder.Recorder) -> None:
    """The ring of detail `record --max-size` asked for, if any."""
    try:
        from gputrace.recorder import ring

        ring.from_env(rec)
    except Exception as e:  # noqa: BLE001 - recorded without a bound instead
        print(f"gputrace: no --max-size ({type(e).__name__}: {e}); keeping every "
              "iteration's detail", file=sys.stderr)


def boot(shard_dir: str) -> _recorder.Recorder:
    """Start this process's recorder writing a shard into shard_dir."""
    global _shard_dir
    _shard_dir = shard_dir
    md = base_metadata("process")
    rec = _recorder.Recorder(shard_path(shard_dir), md)
    _window(rec)
    _max_size(rec)
    with contextlib.suppress(Exception):   # the process is recorded all the same
        from gputrace.collectors import memory

        memory.install(rec)
    rec.start()
    _recorder.set_current(rec)
    atexit.register(_close_current)
    os.register_at_fork(after_in_child=_after_fork)
    if "multiprocessing" in sys.modules:
        _register_mp_finalizer()
    else:  # imported later: its forked children must still flush before os._exit
        sys.meta_path.insert(0, _PostImportFinder("multiprocessing",
                                                  lambda _m: _register_mp_finalizer()))
    if os.environ.get("GPUTRACE_NO_TORCH") != "1":
        _when_imported("torch", _on_torch)
    if os.environ.get("GPUTRACE_NO_TENSORFLOW") != "1":
        _when_imported("tensorflow", _on_tensorflow)
        _when_imported("keras", _on_keras)
        _when_imported("tf_keras", _on_keras)   # Keras 2 (TF_USE_LEGACY_KERAS)
    return rec


def _when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        def imported(module: ModuleType) -> None:
            from gputrace.collectors import process

            process.IMPORTED_WHILE_RECORDING.add(name)   # its import ends now (start-up)
            callback(module)

        sys.meta_path.insert(0, _PostImportFinder(name, imported))


def _on_tensorflow(tf: ModuleType) -> None:
    _tf_hook("on_tensorflow", tf)


def _on_keras(keras: ModuleType) -> None:
    _tf_hook("on_keras", keras)


def _tf_hook(which: str, module: ModuleType) -> None:
    rec = _recorder.current()
    if rec is None:
        return
    try:
        from gputrace.collectors import tensorflow as tf_collector

        getattr(tf_collector, which)(rec, module)
    except Exception as e:  # never break the job
        status = f"unavailable: instrumentation failed: {type(e).__name__}: {e}"
        print(f"gputrace: tensorflow {status}".splitlines()[0], file=sys.stderr)
        rec.set_collector("tensorflow", status)


def _close_current() -> None:
    rec = _recorder.current()
    if rec is not None:
        rec.close()


def _after_fork() -> None:
    rec = _recorder.current()
    if rec is not None and _shard_dir:
        rec.reset_after_fork(shard_path(_shard_dir))


def _register_mp_finalizer() -> None:
    # multiprocessing children leave through os._exit, past atexit; their finalizers do run.
    global _mp_registered
    if _mp_registered:
        return
    _mp_registered = True
    import multiprocessing.util as mpu

    def in_child(_: object) -> None:
        mpu.Finalize(None, _close_current, exitpriority=100)

    mpu.register_after_fork(_register_mp_finalizer, in_child)


def _on_torch(torch: ModuleType) -> None:
    rec = _recorder.current()
    if rec is None:
        return
    try:
        from gputrace.collectors import torch as torch_collector
    except Exception as e:
        rec.set_collector("torch", f"unavailable: {e}")
        return
    try:
        status = torch_collector.auto_instrument(rec)
    except Exception as e:  # never break the job
        status = f"unavailable: instrumentation failed: {type(e).__name__}: {e}"
        print(f"gputrace: torch {status}", file=sys.stderr)
    rec.set_collector("torch", status)
    if os.environ.get("GPUTRACE_NO_CUPTI") != "1":
        from gputrace.collectors import start_gpu_timeline

        start_gpu_timeline(rec, torch, os.environ.get("GPUTRACE_GPU_TIMELINE", "auto"))
    if "multiprocessing" in sys.modules:
        _register_mp_finalizer()


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callback: Callable[[ModuleType], None]):
        self.inner = inner
        self.callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)  # type: ignore[attr-defined]
        self.callback(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs a callback right after a top-level module finished importing.

    It stays on sys.meta_path until the module is really imported: a library asking only
    whether the module exists (`importlib.util.find_spec("keras")`, as TensorFlow does when
    it is imported before keras) gets a spec that is never executed, and must not use up
    the hook."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self._looking = threading.local()

    def _imported(self, module: ModuleType) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        self.callback(module)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> Any:
        if fullname != self.name or getattr(self._looking, "now", False):
            return None
        self._looking.now = True
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and \
                            not isinstance(spec.loader, _HookedLoader):
                        spec.loader = _HookedLoader(spec.loader, self._imported)
                    return spec
            return None
        finally:
            self._looking.now = False
