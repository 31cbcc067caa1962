"""The training loop's iterations on a recorder: where one begins and ends (`step`, the wait
for the next batch), written as `iteration` spans; a mixin of `Recorder`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

T = TypeVar("T")


class Iterations:
    """Iteration boundaries of a Recorder (its `clock`, `span`, `step`, `_iter_start` and
    `_iter_live`)."""

    clock: Any
    step: int
    _iter_start: int | None
    _iter_live: bool
    # each called with ("open" | "close" | "drop", step, t_ns, name) as iterations begin,
    # end (`name`: `iteration` or `inference`) or are dropped unended (the FLOP count of one
    # iteration: collectors.torch.flops; CUPTI on only inside a window: collectors.cupti)
    iteration_watchers: tuple[Any, ...] = ()

    if TYPE_CHECKING:
        def span(self, cat: str, name: str, start_ns: int, end_ns: int, **kw: Any) -> None: ...

    def open_iteration(self, t_ns: int) -> None:
        if self._iter_start is None:
            self._iter_start = t_ns
            self._iter_live = False
            for w in self.iteration_watchers:
                w("open", self.step, t_ns, "")

    def close_iteration(self, t_ns: int, name: str = "iteration", reopen: bool = False) -> None:
        """End the open iteration at t_ns (`name`: `iteration`, or `inference` for a batch
        that trained nothing). `reopen`: the next one begins here (iterations tile the loop;
        one that sees no span before the recording ends is dropped)."""
        start, self._iter_start = self._iter_start, None
        if start is not None:
            self.span("iteration", name, start, t_ns, step=self.step)
            for w in self.iteration_watchers:
                w("close", self.step, t_ns, name)
            self.step += 1
        if reopen:
            self.open_iteration(t_ns)

    def close_evaluation(self, t_ns: int) -> None:
        """End the open iteration at t_ns as an evaluation batch, not a training iteration:
        an `evaluation` span named `batch` (step -1); the step is not counted, and the next
        iteration opens at t_ns with it (watchers see the one that was open dropped)."""
        start, self._iter_start = self._iter_start, None
        if start is not None:
            self.span("evaluation", "batch", start, t_ns, step=-1)
            for w in self.iteration_watchers:
                w("drop", self.step, start, "")
        self.open_iteration(t_ns)

    def drop_iteration(self) -> None:
        if self._iter_start is not None:
            for w in self.iteration_watchers:
                w("drop", self.step, self._iter_start, "")
        self._iter_start = None

    def iterate(self, iterable: Iterable[T], name: str = "next") -> Iterator[T]:
        """Yield items; time spent waiting for each is an `io` span inside its iteration."""
        it = iter(iterable)
        now = self.clock.now_ns
        while True:
            t0 = now()
            if self._iter_start is not None and self._iter_live:
                # the loop did not call step(): asking for the next item ends the iteration
                self.close_iteration(t0)
            # it begins when the loop asks for its batch (also after a step(): nothing
            # happened since, the loop only came back for the next item)
            self._iter_start = None
            self.open_iteration(t0)
            try:
                item = next(it)
            except StopIteration:
                self.drop_iteration()
                return
            self.span("io", name, t0, now())
            yield item

    def step_done(self) -> None:
        self.close_iteration(self.clock.now_ns(), reopen=True)
