"""Which DeviceMesh dimension a process group is: the meshes the job makes
(`init_device_mesh`, `DeviceMesh(...)`, their slices) are kept (weakly) as they are made, and a
collective's group is looked up once among them. A comm span's `group` then says
`"mesh": {"dim": "tp", "dims": ["dp", "tp"], "shape": [2, 2]}`: the dimension of the largest
mesh the group belongs to, and that mesh's names and shape. What the analysis reads to tell
tensor-, data-, pipeline-, expert- and context-parallel communication apart."""

from __future__ import annotations

import functools
import weakref
from typing import Any

from gputrace.collectors.torch.guard import _hook_failed

_meshes: list[weakref.ref[Any]] = []    # in the order they were made
made = [0]     # meshes made so far: a group's description read before the last one is stale
_installed = False


def install() -> None:
    """Keep every DeviceMesh made from now on (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from torch.distributed import device_mesh
    except Exception:  # noqa: BLE001 - a torch without distributed
        return
    cls = getattr(device_mesh, "DeviceMesh", None)
    if cls is None or getattr(cls.__init__, "_gputrace_orig", None) is not None:
        return
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self: Any, *a: Any, **k: Any) -> None:
        orig(self, *a, **k)
        try:
            _meshes[:] = [r for r in _meshes if r() is not None]
            _meshes.append(weakref.ref(self))
            made[0] += 1
        except Exception as e:  # noqa: BLE001 - the mesh is made; only its name is lost
            _hook_failed("DeviceMesh", e)

    __init__._gputrace_orig = orig  # type: ignore[attr-defined]
    cls.__init__ = __init__


def mesh_of(group_name: str) -> dict[str, Any] | None:
    """{"dim", "dims", "shape"} of the largest kept mesh one of whose dimensions is the group
    named `group_name` (of two as large, the one made first: transformers' dense mesh, not
    its expert mesh whose `efsdp` dimension may be the same group as the dense `fsdp`), or
    None."""
    best = None
    for ref in list(_meshes):
        m = ref()
        if m is None:
            continue
        names = getattr(m, "_dim_group_names", None) or []
        if group_name not in names:
            continue
        dims = getattr(m, "mesh_dim_names", None)
        shape = tuple(int(x) for x in m.mesh.shape)
        if best is None or len(shape) > len(best[1]):
            i = list(names).index(group_name)
            best = (dims[i] if dims else f"dim_{i}", shape, list(dims) if dims else None)
    if best is None:
        return None
    dim, shape, dims = best
    return {"dim": dim, "dims": dims or [f"dim_{i}" for i in range(len(shape))],
            "shape": list(shape)}
