"""A GPU collector that costs the job (CUPTI, the torch.profiler fallback) records only the
iterations a recording window wants: its records are turned on when such an iteration opens
and off when one it does not want opens, so that outside the window the job pays nothing
for them. Records that still come outside are left out at the flush, as before."""

from __future__ import annotations

import contextlib
import sys
from typing import Any


class WindowGate:
    """Mixin: `_switch(on)` turns the collector's records on or off; `label` names it in the
    one line said when that fails (it then records throughout)."""

    recorder: Any
    label = "gpu"
    on = True           # its records are on (off: outside a recording window)
    switches = 0        # times they were turned on or off at an iteration's start

    def _switch(self, on: bool) -> None:
        raise NotImplementedError

    def watch_window(self) -> None:
        """From now on, on at the iterations the window wants; off already where it does
        not want the one to come (what runs before the loop's first iteration opens)."""
        r = self.recorder
        r.iteration_watchers = (*r.iteration_watchers, self.on_iteration)
        if getattr(r, "window", None) is not None and r._iter_start is None:
            self.on_iteration("open", r.step, r.clock.now_ns())

    def on_iteration(self, event: str, step: int, t_ns: int, name: str = "") -> None:
        w = getattr(self.recorder, "window", None)
        if event != "open" or w is None:
            return
        want = w.wants(step, t_ns)
        if want == self.on:
            return
        try:
            self._switch(want)
            self.on = want
            self.switches += 1
        except Exception as e:  # noqa: BLE001 - recorded throughout instead
            self.recorder.iteration_watchers = tuple(
                x for x in self.recorder.iteration_watchers if x != self.on_iteration)
            print(f"gputrace: {self.label}: could not turn its records {'on' if want else 'off'}"
                  f" at a window's edge ({type(e).__name__}: {e}); recording them throughout",
                  file=sys.stderr)
            with contextlib.suppress(Exception):
                self._switch(True)
            self.on = True
