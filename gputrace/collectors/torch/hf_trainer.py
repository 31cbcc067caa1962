"""Hugging Face's Trainer's whole run on the recorder: each `Trainer.evaluate` an
`evaluation` span named `pass` (`args.framework` transformers, `args.batches`), and each of
its checkpoints (`Trainer._save_checkpoint`: the model, optimizer and state under
`checkpoint-<step>`) a `checkpoint` span named `transformers.save_checkpoint` with the bytes
its folder holds; the saves inside it are part of it. Patched when transformers' trainer is
imported."""

from __future__ import annotations

import os
from typing import Any

from gputrace.collectors.torch import checkpoint, framework_pass, lazy

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
    cls.evaluate = framework_pass.wrap(get_state, cls.evaluate, "transformers")


def install(get_state: Any) -> None:
    lazy.when_imported(TRAINER, lambda m: _patch(get_state, m), "HF Trainer's evaluation")
