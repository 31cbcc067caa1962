"""A framework's own evaluation loop as one `evaluation` span named `pass` (HF Trainer's
`evaluate`, Lightning's evaluation loop): the iterations told where it begins and ends
(iterations.framework_pass), `args.batches` the batches that ended in it, `args.framework`
its name, and what `more(self)` adds. A pass inside a pass is the outer one's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from gputrace.collectors.torch.guard import _guarded


def wrap(get_state: Any, orig: Any, framework: str,
         more: Callable[[Any], dict[str, Any]] | None = None) -> Any:
    """`orig` (a method) timed as a pass; `orig` itself where it is wrapped already."""
    if getattr(orig, "_gputrace", False):
        return orig

    @_guarded
    def begin() -> int:
        st = get_state()
        t = st.now()
        st.its.framework_pass(True, t)
        return t

    @_guarded
    def end(obj: Any, t0: int) -> None:
        st = get_state()
        t = st.now()
        n = st.its.framework_pass(False, t)
        st.rec.span("evaluation", "pass", t0, t, step=-1,
                    args={"batches": n, "framework": framework,
                          **(more(obj) if more is not None else {})})

    @functools.wraps(orig)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = get_state()
        if st is None or getattr(getattr(st, "its", None), "fw_pass", False):   # nested: outer
            return orig(self, *args, **kwargs)
        t0 = begin()
        try:
            return orig(self, *args, **kwargs)
        finally:
            if t0 is not None:
                end(self, t0)

    run._gputrace = True  # type: ignore[attr-defined]
    return run
