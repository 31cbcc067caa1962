"""Which modules of a PyTorch job are timed (`GPUTRACE_LAYERS`: blocks, leaves or off), read
from the environment and chosen under a model root at its first forward; which of them are
tensor parallel and so timed per call (collectors.torch.modules installs the hooks)."""

from __future__ import annotations

import os
import sys

import torch.nn as nn

MODES = ("blocks", "leaves", "off")
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def mode_from_env(value: str | None) -> str:
    """GPUTRACE_LAYERS: blocks (default), leaves or off; anything else is one line and the
    default."""
    if not value:
        return "blocks"
    v = value.strip().lower()
    if v in MODES:
        return v
    print(f"gputrace: GPUTRACE_LAYERS={value!r} is not one of {', '.join(MODES)}; "
          "using blocks", file=sys.stderr)
    return "blocks"


def forward_from_env(value: str | None) -> bool:
    """GPUTRACE_LAYER_FORWARD: 1 times each chosen module's forward too."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _owns(m: nn.Module) -> bool:
    return any(p is not None for p in m._parameters.values())


def _compiled(m: nn.Module) -> bool:
    """Whether `m` is torch.compile's: an OptimizedModule (`torch.compile(model)`) or a
    module compiled in place (`model.compile()`). Not importing torch._dynamo to ask (1 s
    of each process's start): a module made by it is there only where it was imported."""
    ev = sys.modules.get("torch._dynamo.eval_frame")
    return (ev is not None and isinstance(m, ev.OptimizedModule)) or \
        getattr(m, "_compiled_call_impl", None) is not None


def choose(root: nn.Module, mode: str) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The modules to time under `root`, in registration order, each with the parameters
    whose gradients make its backward (a block: all of its subtree's; otherwise its own)."""
    if mode == "off":
        return []
    out: list[tuple[nn.Module, list[nn.Parameter]]] = []
    has: dict[int, bool] = {}

    def holds(m: nn.Module) -> bool:
        k = id(m)
        if k not in has:
            has[k] = _owns(m) or any(holds(c) for c in m._modules.values() if c is not None)
        return has[k]

    seen: set[int] = set()

    def walk(m: nn.Module, in_container: bool) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        kids = [c for c in m._modules.values() if c is not None and holds(c)]
        if mode == "blocks" and in_container and kids and not isinstance(m, _CONTAINERS):
            out.append((m, list(m.parameters())))
            return
        if _owns(m):
            out.append((m, [p for p in m._parameters.values() if p is not None]))
        for c in kids:
            walk(c, isinstance(m, _CONTAINERS))

    walk(root, False)
    return out


def _tp(m: nn.Module, params: list[nn.Parameter]) -> bool:
    """A tensor-parallel module (its parameters DTensors, not FSDP2's alone: on a mesh of
    more than one dimension, or in a module FSDP does not manage): its forward runs
    DTensor's dispatch and hooks already; timed per call too, so that the collectives its
    forward issues are told by layer."""
    mod = sys.modules.get("torch.distributed.tensor")
    dt = getattr(mod, "DTensor", None) if mod is not None else None
    if dt is None:
        return False
    fsdp = any(type(x).__name__.startswith("FSDP") for x in m.modules())
    return any(isinstance(p, dt) and (p.device_mesh.ndim > 1 or not fsdp) for p in params)


def env_mode() -> str:
    return mode_from_env(os.environ.get("GPUTRACE_LAYERS"))


def env_forward() -> bool:
    return forward_from_env(os.environ.get("GPUTRACE_LAYER_FORWARD"))
