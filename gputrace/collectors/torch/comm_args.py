"""What a recorded collective's arguments say: this rank's input and output bytes (per
collective, where its tensors are), its process group (size, ranks, name, description, its
DeviceMesh dimension), and an all-to-all's bytes to each peer."""

from __future__ import annotations

import json
from typing import Any

from gputrace.collectors.torch.mesh import made, mesh_of

_groups: dict[Any, tuple[int, str]] = {}   # group: (meshes made then, its JSON)
_c10d: list[Any] = [None]    # torch.distributed.distributed_c10d, once installed


def _nb(t: Any) -> int:
    try:
        return t.numel() * t.element_size()
    except AttributeError:
        return 0


def _nbl(ts: Any) -> int:
    return sum(_nb(t) for t in ts) if ts else 0


# name -> (kind, input (pos, kw, is_list) | None, output ... | None, group (pos, kw))
_SPECS: dict[str, tuple[str, Any, Any, tuple[int, str]]] = {
    "all_reduce": ("all_reduce", (0, "tensor", 0), (0, "tensor", 0), (2, "group")),
    "all_gather": ("all_gather", (1, "tensor", 0), (0, "tensor_list", 1), (2, "group")),
    "all_gather_single": ("all_gather", (1, "input_tensor", 0), (0, "output_tensor", 0),
                          (2, "group")),
    "all_gather_into_tensor": ("all_gather", (1, "input_tensor", 0), (0, "output_tensor", 0),
                               (2, "group")),
    "_all_gather_base": ("all_gather", (1, "input_tensor", 0), (0, "output_tensor", 0),
                         (2, "group")),
    "reduce_scatter": ("reduce_scatter", (1, "input_list", 1), (0, "output", 0), (3, "group")),
    "reduce_scatter_single": ("reduce_scatter", (1, "input", 0), (0, "output", 0),
                              (3, "group")),
    "reduce_scatter_tensor": ("reduce_scatter", (1, "input", 0), (0, "output", 0),
                              (3, "group")),
    "_reduce_scatter_base": ("reduce_scatter", (1, "input", 0), (0, "output", 0),
                             (3, "group")),
    "broadcast": ("broadcast", (0, "tensor", 0), (0, "tensor", 0), (2, "group")),
    "reduce": ("reduce", (0, "tensor", 0), (0, "tensor", 0), (3, "group")),
    "gather": ("gather", (0, "tensor", 0), (1, "gather_list", 1), (3, "group")),
    "scatter": ("scatter", (1, "scatter_list", 1), (0, "tensor", 0), (3, "group")),
    "all_to_all_single": ("all_to_all", (1, "input", 0), (0, "output", 0), (4, "group")),
    "all_to_all": ("all_to_all", (1, "input_tensor_list", 1), (0, "output_tensor_list", 1),
                   (2, "group")),
    "send": ("send_recv", (0, "tensor", 0), None, (2, "group")),
    "isend": ("send_recv", (0, "tensor", 0), None, (2, "group")),
    "recv": ("send_recv", None, (0, "tensor", 0), (2, "group")),
    "irecv": ("send_recv", None, (0, "tensor", 0), (2, "group")),
    "barrier": ("barrier", None, None, (0, "group")),
}


def _group_json(group: Any) -> str:
    """{"size", "ranks" (up to 64), "name", "desc" (its description, e.g. `mesh_tp`), "mesh"
    (its DeviceMesh dimension: collectors.torch.mesh)} of a process group, computed once per
    group and again after a DeviceMesh is made (a mesh made after the group's first use, as
    a 1-D mesh over the default group is, names it from then on)."""
    if group is None:
        group = _c10d[0]._world.default_pg
    got = _groups.get(group)
    s = got[1] if got is not None and got[0] == made[0] else None
    if s is None:
        c10d = _c10d[0]
        size = group.size()
        d: dict[str, Any] = {"size": size}
        if size <= 64:
            d["ranks"] = c10d.get_process_group_ranks(group)
        d["name"] = str(getattr(group, "group_name", ""))
        desc = getattr(group, "group_desc", None)
        if isinstance(desc, str) and desc and desc != "undefined":
            d["desc"] = desc
        mesh = mesh_of(d["name"])
        if mesh is not None:
            d["mesh"] = mesh
        s = json.dumps(d, separators=(",", ":"))
        _groups[group] = (made[0], s)
    return s


def _extractor(spec: Any, nbytes: bool) -> Any:
    """(args, kwargs) -> the argument `spec` names (its bytes when `nbytes`), made once per
    function so the call pays no generic lookup."""
    if spec is None:
        return lambda a, k: 0
    i, name = spec[0], spec[1]
    if not nbytes:
        return lambda a, k: a[i] if len(a) > i else k.get(name)
    size = _nbl if spec[2] else _nb
    return lambda a, k: size(a[i] if len(a) > i else k.get(name))


def _integer(t: Any) -> str:
    """`,"integer":true` for a tensor of integers (an all-to-all of counts, not tokens)."""
    try:
        return "" if t is None or t.is_floating_point() or t.is_complex() else \
            ',"integer":true'
    except AttributeError:
        return ""


def _peers(a: tuple[Any, ...], k: dict[str, Any]) -> str:
    """`,"peers":[bytes to rank 0 of the group, ...]` of an all-to-all ("" when unknown):
    a list's tensors, or a single tensor's input splits (even without them), with
    `"splits":[rows to each peer]` for a single tensor (`"even":true` where the call gave
    no split sizes: its first dimension cut evenly, whatever that dimension holds) and
    `"integer":true` where it moves integers (a count exchange)."""
    try:
        if "input_tensor_list" in k or (len(a) > 1 and isinstance(a[1], (list, tuple))):
            ins = a[1] if len(a) > 1 else k["input_tensor_list"]
            return (f',"peers":{json.dumps([_nb(t) for t in ins])}'
                    + _integer(ins[0] if ins else None))
        x = a[1] if len(a) > 1 else k.get("input")
        splits = a[3] if len(a) > 3 else k.get("input_split_sizes")
        group = a[4] if len(a) > 4 else k.get("group")
        rows = x.shape[0] if x.dim() else 1
        per_row = _nb(x) // max(rows, 1)
        even = "" if splits else ',"even":true'
        if not splits:
            n = (group or _c10d[0]._world.default_pg).size()
            splits = [rows // n] * n
        return (f',"peers":{json.dumps([int(s) * per_row for s in splits])}'
                f',"splits":{json.dumps([int(s) for s in splits])}{even}' + _integer(x))
    except Exception:  # noqa: BLE001 - a shape we do not know: the total bytes stay
        return ""
