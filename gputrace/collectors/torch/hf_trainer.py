"""Hugging Face's Trainer's whole run on the recorder: each `Trainer.evaluate` an
`evaluation` span named `pass` (`args.framework` transformers, `args.batches`), and each of
its checkpoints (`Trainer._save_checkpoint`: the model, optimizer and state under
`checkpoint-<step>`) a `checkpoint` span named `transformers.save_checkpoint` with the bytes
its folder holds; the saves inside it are part of it. Patched when transformers' trainer is
imported."""

from __future__ import annotations

import functools
import os
from typing import Any

from gputrace.collectors.torch import checkpoint, lazy
from gputrace.collectors.torch.guard import _guarded

TRAINER = "transformers.trainer"


def _folder_bytes(args: Any, kwargs: Any, out: Any, before: Any) -> int | None:
    """The bytes under the checkpoint folder the save wrote (`checkpoint-<global step>`)."""
    tr = args[0]
    trial = args[2] if len(args) > 2 else kwargs.get("trial")
    path = os.path.join(tr._get_output_dir(trial=trial),
                        f"checkpoint-{tr.state.global_step}")
    if not os.path.isdir(path):
        return None
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _patch(get_state: Any, mod: Any) -> None:
    cls = mod.Trainer
    cls._save_checkpoint = checkpoint._wrap(get_state, "transformers.save_checkpoint", "save",
                                            cls._save_checkpoint, _folder_bytes)
    orig = cls.evaluate
    if getattr(orig, "_gputrace", False):
        return

    @_guarded
    def begin() -> int:
        st = get_state()
        t = st.now()
        st.its.framework_pass(True, t)
        return t

    @_guarded
    def end(t0: int) -> None:
        st = get_state()
        t = st.now()
        n = st.its.framework_pass(False, t)
        st.rec.span("evaluation", "pass", t0, t, step=-1,
                    args={"batches": n, "framework": "transformers"})

    @functools.wraps(orig)
    def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = get_state()
        if st is None or st.its.fw_pass:        # a nested evaluate: the outer one is it
            return orig(self, *args, **kwargs)
        t0 = begin()
        try:
            return orig(self, *args, **kwargs)
        finally:
            if t0 is not None:
                end(t0)

    evaluate._gputrace = True  # type: ignore[attr-defined]
    cls.evaluate = evaluate


def install(get_state: Any) -> None:
    lazy.when_imported(TRAINER, lambda m: _patch(get_state, m), "HF Trainer's evaluation")
