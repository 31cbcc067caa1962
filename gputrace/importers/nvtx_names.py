"""What the NVTX ranges of common tools say: autograd's `emit_nvtx` op ranges,
Megatron-Core's function-path ranges and NeMo's optimizer step, as gputrace phases."""

from __future__ import annotations

import re

# torch.autograd.profiler.emit_nvtx: "aten::mul, seq = 45328, op_id = 990354, sizes = [...]"
# (the forward op's sequence number; a backward node carries the seq of the forward op that
# made it, under its own name, e.g. "MulBackward0, seq = 45328, op_id = ...")
_EMIT_NVTX = re.compile(r",\s*(?:seq|op_id|sizes|input_op_ids)\s*=")
_SEQ = re.compile(r",\s*seq\s*=\s*(\d+)")
# Megatron-Core's nvtx_range_push(msg=None, suffix=...) names a range by the calling
# function's module path, e.g. "megatron.core.transformer.transformer_layer.
# TransformerLayer._forward_attention.self_attention"
_MEGATRON = re.compile(r"^megatron\.[\w.]*?\.(_?forward\w*|_?backward\w*)(?:\.|$)")
# NeMo 2 (nemo/core/optim/mcore_optim.py, McoreDistributedOptimizer.step, with NsysCallback's
# nvtx_ranges=True) wraps Megatron-Core's optimizer step in "<NVTX_LABEL>.step.step" and
# Lightning's closure, the forward and the backward together, in "<NVTX_LABEL>.step.closure";
# its own callbacks otherwise emit autograd's emit_nvtx ranges and Megatron-Core's
_NEMO_UPDATE = "nemo.core.optim.mcore_optim.step.step"


def emit_nvtx(text: str) -> tuple[str, int | None]:
    """(the op's name, its autograd sequence number or None) of an `emit_nvtx` range; a
    range of another kind comes back as it is, with None."""
    m = _EMIT_NVTX.search(text)
    if not m:
        return text, None
    s = _SEQ.search(text)
    return text[:m.start()].strip(), int(s.group(1)) if s else None


def convention_phase(name: str) -> str | None:
    """'forward', 'backward' or 'update' for a range named by a framework's convention
    (Megatron-Core's function paths, NeMo's optimizer step), else None."""
    if name == _NEMO_UPDATE:
        return "update"
    m = _MEGATRON.match(name)
    if m and "forward_backward" not in m.group(1):   # the schedule: both passes
        return "backward" if "backward" in m.group(1) else "forward"
    return None
