"""The run around the iterations: the process's life as recorded (a `process` span named
`run`: collectors.process), the distributed initialization (`startup` spans named
`init_process_group`) and torch.compile's compilations (`startup` spans named `compile`,
from torch._dynamo's own start and end of each: the first call's, a backward's compiled at
its first run, a recompilation), all step -1."""

from __future__ import annotations

import functools
from typing import Any

from gputrace.collectors.process import IMPORTED_WHILE_RECORDING, install_run_span
from gputrace.collectors.torch import flight, lazy
from gputrace.collectors.torch.guard import _guarded
from gputrace.recorder.core import Recorder


def install(rec: Recorder, get_state: Any) -> None:
    """The process's `run` span at close (collectors.process); init_process_group timed."""
    install_run_span(rec, "torch imported" if "torch" in IMPORTED_WHILE_RECORDING else None)
    _patch_init(get_state)
    # torch.compile imports it at its first call (import torch does not)
    lazy.when_imported("torch._dynamo.callback", lambda m: _watch_compiles(get_state, m),
                       "torch.compile's compilations")


def _watch_compiles(get_state: Any, module: Any) -> None:
    """A `compile` span per compilation, from torch._dynamo's callbacks (run around the
    outermost compilation only, so never nested)."""
    began: list[int] = []

    @_guarded
    def start(args: Any) -> None:
        st = get_state()
        if st is not None:
            began[:] = [st.now()]

    @_guarded
    def end(args: Any) -> None:
        st = get_state()
        if st is not None and began:
            trigger = getattr(getattr(args, "callback_trigger", None), "name", None)
            st.rec.span("startup", "compile", began.pop(), st.now(), step=-1,
                        args={"trigger": trigger, "compile_id": str(args.compile_id)})

    module.callback_handler.register_start_callback(start)
    module.callback_handler.register_end_callback(end)


def _patch_init(get_state: Any) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - a torch built without distributed
        return
    orig = c10d.init_process_group
    if getattr(orig, "_gputrace", False):
        return

    @_guarded
    def done(t0: int) -> None:
        st = get_state()
        if st is not None:
            st.rec.span("startup", "init_process_group", t0, st.now(), step=-1)
            flight.joined(st.rec, c10d._world.default_pg)

    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        st = get_state()
        t0 = st.now() if st is not None else 0
        out = orig(*args, **kwargs)
        if t0:
            done(t0)
        return out

    init_process_group._gputrace = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    if getattr(dist, "init_process_group", None) is orig:
        dist.init_process_group = init_process_group
