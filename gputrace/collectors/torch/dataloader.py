"""torch's DataLoader on the recorder: the training loop's wait for each batch (an `io`
span, and the boundary of its iteration, collectors.torch.iterations), each fetch in the
loader's worker processes (`io` spans named `fetch`, step -1: the total I/O work) and each
start of a loader (`loader` spans named `DataLoader.__iter__`, step -1: its workers' start,
no part of an iteration)."""

from __future__ import annotations

from typing import Any

from gputrace.collectors.torch.guard import _guarded
from gputrace.recorder.core import Recorder


def patch_dataloader(state: Any) -> None:
    """The loop's wait for each batch (`io` spans, the iteration's boundary) and each
    fetch in the loader's workers, on torch's DataLoader classes."""
    import torch.utils.data._utils.fetch as fetch
    import torch.utils.data.dataloader as dl

    now = state.now
    orig_next = dl._BaseDataLoaderIter.__next__

    @_guarded
    def batch() -> int:
        t = now()
        state.its.batch(t)         # the iteration it opens first: the read is of that one
        state.mem("io", 0, t)
        return t

    @_guarded
    def fetched(t0: int) -> None:
        state.mem("io", 1, now())
        state.rec.span("io", "DataLoader.__next__", t0, now())

    @_guarded
    def exhausted(t0: int) -> None:
        t = now()
        # the request that found the loader empty (its workers' shut-down): no iteration's
        state.rec.span("loader", "exhausted", t0, t, step=-1)
        state.its.exhausted(t0, t)

    def __next__(self: Any) -> Any:
        t0 = batch() or now()
        try:
            out = orig_next(self)
        except StopIteration:
            exhausted(t0)
            raise
        fetched(t0)
        return out

    dl._BaseDataLoaderIter.__next__ = __next__

    orig_iter = dl.DataLoader.__iter__

    @_guarded
    def started(t0: int) -> None:
        state.rec.span("loader", "DataLoader.__iter__", t0, now(), step=-1)
        state.its.aside(t0, True)

    def __iter__(self: Any) -> Any:
        t0 = now()
        out = orig_iter(self)
        started(t0)
        return out

    dl.DataLoader.__iter__ = __iter__

    for cls in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher):
        orig_fetch = cls.fetch

        def fetch_(self: Any, index: Any, _orig: Any = orig_fetch) -> Any:
            t0 = now()
            try:
                return _orig(self, index)
            finally:
                r = _current_rec()
                if r is not None:
                    r.span("io", "fetch", t0, r.clock.now_ns(), step=-1)

        cls.fetch = fetch_


def _current_rec() -> Recorder | None:
    from gputrace.recorder.core import current

    return current()
