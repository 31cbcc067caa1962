"""Frameworks' saves outside a trainer on the recorder, each a `checkpoint` span (as
torch.save's: collectors.torch.checkpoint) holding the saves inside it:

- DeepSpeed's `DeepSpeedEngine.save_checkpoint`: `deepspeed.save_checkpoint`, the bytes this
  rank's torch.save calls inside it wrote (its model and optimizer states' files);
- Hugging Face's `PreTrainedModel.save_pretrained`: `transformers.save_pretrained`, the
  bytes of the files it wrote or rewrote under its folder (safetensors or torch.save).

Patched when their modules are imported."""

from __future__ import annotations

from typing import Any

from gputrace.collectors.files import files_at
from gputrace.collectors.torch import checkpoint, lazy

DS_ENGINE = "deepspeed.runtime.engine"
HF_MODEL = "transformers.modeling_utils"


def _folder_of(args: Any, kwargs: Any) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("save_directory")


def _before(args: Any, kwargs: Any) -> dict[str, tuple[int, int]]:
    return files_at(_folder_of(args, kwargs))


def _written(args: Any, kwargs: Any, out: Any, before: Any) -> int | None:
    """The bytes of the files the save made or changed under its folder."""
    after = files_at(_folder_of(args, kwargs))
    if not after:
        return None
    old = before if isinstance(before, dict) else {}
    return sum(size for p, (size, mt) in after.items() if old.get(p) != (size, mt))


def _patch_ds(get_state: Any, mod: Any) -> None:
    cls = mod.DeepSpeedEngine
    cls.save_checkpoint = checkpoint._wrap(get_state, "deepspeed.save_checkpoint", "save",
                                           cls.save_checkpoint, checkpoint.inner_bytes)


def _patch_hf(get_state: Any, mod: Any) -> None:
    cls = mod.PreTrainedModel
    cls.save_pretrained = checkpoint._wrap(get_state, "transformers.save_pretrained", "save",
                                           cls.save_pretrained, _written, _before)


def install(get_state: Any) -> None:
    lazy.when_imported(DS_ENGINE, lambda m: _patch_ds(get_state, m),
                       "DeepSpeed's save_checkpoint")
    lazy.when_imported(HF_MODEL, lambda m: _patch_hf(get_state, m),
                       "Hugging Face's save_pretrained")
