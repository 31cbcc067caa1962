"""`gputrace.torch.instrument(...)`: the PyTorch auto-instrumentation for harnesses that do
not run under `gputrace record`."""

from __future__ import annotations

from typing import Any

from gputrace.recorder import core as _recorder


def instrument(model: Any = None, optimizer: Any = None, loader: Any = None,
               session: Any = None, gpu_timeline: str | None = "auto") -> str:
    """Install gputrace's torch hooks on the session's recorder (or the current one).

    Optimizers and DataLoaders are hooked globally, and models are found as they are built
    (and, here, among the models that exist already), so `model`, `optimizer` and `loader`
    are optional; a model given here has its layers numbered now, in registration order,
    instead of at its first forward. `gpu_timeline` ("auto", "cupti",
    "kineto", or None for none) starts the GPU kernel/copy timeline as `record
    --gpu-timeline` does, unless one runs already. Returns the torch collector's status.
    """
    rec = session.recorder if session is not None else _recorder.current()
    if rec is None:
        raise RuntimeError("no gputrace recorder: call inside `with gputrace.Session(...)` "
                           "or run under `gputrace record`")
    from gputrace.collectors import torch as torch_collector

    status = torch_collector.auto_instrument(rec)
    rec.set_collector("torch", status)
    if gpu_timeline is not None and "cupti" not in rec.metadata.get("collectors", {}):
        import torch

        from gputrace.collectors import start_gpu_timeline

        start_gpu_timeline(rec, torch, gpu_timeline)
    state = torch_collector._installed
    if state is not None:
        if model is not None:
            state.modules.adopt([model])
            from gputrace.collectors.torch.modules import choose

            for m, params in choose(model, state.modules.mode):
                state.layer_for(m, params)
        else:
            state.modules.adopt_live()
    return status
