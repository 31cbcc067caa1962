"""Patching torch's modules when the job imports them (FSDP's, the pipeline schedules',
DTensor's), or at once where they already are: one finder on sys.meta_path for all of them.
A patch that fails is one line on stderr; the module is imported as it is."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

from gputrace.collectors.torch.guard import _hook_failed

# module -> its patches: (patch, what), in the order given
_patches: dict[str, list[tuple[Callable[[Any], None], str]]] = {}


def _patch(name: str, module: Any, only: str | None = None) -> None:
    for fn, what in _patches[name]:
        if only is not None and what != only:
            continue
        try:
            fn(module)
        except Exception as e:  # noqa: BLE001 - the module works unpatched; we lose detail
            _hook_failed(f"{what} ({name})", e)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the modules of `_patches` right after they are first imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        orig = loader.exec_module

        def exec_module(module: Any) -> None:
            orig(module)
            _patch(name, module)

        try:
            loader.exec_module = exec_module
        except Exception:  # noqa: BLE001 - a loader that takes no attributes: unpatched
            return None
        return spec


def when_imported(name: str, patch: Callable[[Any], None], what: str) -> None:
    """patch(module) once `name` is imported: now, if it is (once per `what`)."""
    got = _patches.setdefault(name, [])
    if any(w == what for _, w in got):
        return
    got.append((patch, what))
    mod = sys.modules.get(name)
    if mod is not None:
        _patch(name, mod, what)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
