"""What the job feeds its model: the first outermost forward's input, described once.

A one-shot forward pre-hook (with keyword arguments: `model(**batch)` as Hugging Face's
Trainer calls it) on each model root reads, at the root's first outermost call, the input
tensor (a keyword `input_ids` first, then the first tensor of the positional arguments, then
of the keyword ones, looking two levels into tuples, lists and dicts: Lightning's DDP calls
its wrapper with `(batch, batch_idx)`, the batch a list) and removes itself; the
description goes on that forward's span as `args.batch`:

    {"samples": shape[0], "tokens_per_sample": shape[1] for a 2-D integer tensor (token ids)
     else null, "shape": [...], "dtype": "torch.int64", "input": "Net.forward input_ids"}

The analysis counts the root's forwards per iteration (gradient accumulation, a pipeline's
microbatches) to get the samples per iteration (analyzers/extras/throughput.py)."""

from __future__ import annotations

from typing import Any

import torch

from gputrace.collectors.torch.guard import _hook_failed

_INTS = ("int64", "int32", "int16", "int8", "uint8")   # token ids (torch's dtype names)


def _first_tensor(v: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(v, torch.Tensor):
        return v
    if depth < 2 and isinstance(v, (tuple, list)):
        for x in v:
            t = _first_tensor(x, depth + 1)
            if t is not None:
                return t
    if depth < 2 and isinstance(v, dict):
        for x in v.values():
            t = _first_tensor(x, depth + 1)
            if t is not None:
                return t
    return None


def describe(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The input's description (module docstring), None without a tensor of a batch
    dimension."""
    where, x = "input_ids", kwargs.get("input_ids")
    if not isinstance(x, torch.Tensor):
        where, x = "input", _first_tensor(args)
    if x is None:
        for k, v in kwargs.items():
            x = _first_tensor(v)
            if x is not None:
                where = k
                break
    if x is None or x.dim() < 1:
        return None
    shape = [int(s) for s in x.shape]
    tokens = shape[1] if x.dim() == 2 and str(x.dtype).removeprefix("torch.") in _INTS \
        else None
    return {"samples": shape[0], "tokens_per_sample": tokens, "shape": shape,
            "dtype": str(x.dtype), "input": f"{name}.forward {where}"}


class BatchOnce:
    """The one-shot pre-hook: at the root's first call as the outermost forward (depth 1:
    the root's own pre-hook ran first), the description goes to the state (`st.batch`, put
    on that forward's span when it ends); removed after its first call either way."""

    def __init__(self, st: Any, name: str) -> None:
        self.st, self.name = st, name
        self.handle: Any = None

    def __call__(self, mod: Any, args: Any, kwargs: Any) -> None:
        st = self.st
        try:
            if self.handle is not None:
                self.handle.remove()
                self.handle = None
            if st.depth == 1 and st.batch is None:
                st.batch = describe(self.name, args, kwargs or {}) or {}
        except Exception as e:  # noqa: BLE001 - a profiler never takes the job down
            _hook_failed("batch", e)
