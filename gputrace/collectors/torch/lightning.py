"""PyTorch Lightning's whole run on the recorder: each run of its evaluation loop (the sanity
check, validation, test) an `evaluation` span named `pass` (`args.framework` lightning,
`args.sanity`, `args.batches`: the batches the recorder saw end in it), and
`Trainer.save_checkpoint` (ModelCheckpoint's saves) a `checkpoint` span named
`lightning.save_checkpoint` with the file's bytes; the `torch.save` inside it is part of
it. Patched when Lightning is imported (`lightning` or `pytorch_lightning`)."""

from __future__ import annotations

from typing import Any

from gputrace.collectors.torch import checkpoint, framework_pass, lazy

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _file_bytes(args: Any, kwargs: Any, out: Any, before: Any) -> int | None:
    return checkpoint._size(args[1] if len(args) > 1 else kwargs.get("filepath"))


def _patch_loop(get_state: Any, mod: Any) -> None:
    cls = mod._EvaluationLoop
    cls.run = framework_pass.wrap(get_state, cls.run, "lightning", _sanity)


def _sanity(loop: Any) -> dict[str, Any]:
    trainer = getattr(loop, "trainer", None)
    return {"sanity": bool(getattr(trainer, "sanity_checking", False))}


def _patch_trainer(get_state: Any, mod: Any) -> None:
    cls = mod.Trainer
    cls.save_checkpoint = checkpoint._wrap(get_state, "lightning.save_checkpoint", "save",
                                           cls.save_checkpoint, _file_bytes)


def install(get_state: Any) -> None:
    for pkg in PACKAGES:
        lazy.when_imported(f"{pkg}.loops.evaluation_loop",
                           lambda m: _patch_loop(get_state, m), "Lightning's evaluation loop")
        lazy.when_imported(f"{pkg}.trainer.trainer",
                           lambda m: _patch_trainer(get_state, m), "Lightning's checkpoints")
