"""DTensor's redistributions (tensor, sequence and context parallelism: `parallelize_module`,
`redistribute`, an op whose inputs must be resharded): while one runs, the functional
collectives it issues carry `"issuer":"dtensor"` (collectors.torch.functional), which the
analysis reads as the activation communication of the mesh dimension they run on, not as a
job's own gradient exchange."""

from __future__ import annotations

import sys
from typing import Any

from gputrace.collectors.torch import lazy
from gputrace.collectors.torch.comm import with_tls

REDISTRIBUTE = "torch.distributed.tensor._redistribute"
# modules that import redistribute_local_tensor by name
_USERS = ("torch.distributed.tensor._api", "torch.distributed.tensor._dispatch")


def _wrap(orig: Any) -> Any:
    return with_tls(orig, "dtensor", True)


def _patch(mod: Any) -> None:
    orig = mod.redistribute_local_tensor
    if getattr(orig, "_gputrace_orig", None) is not None:
        return
    w = mod.redistribute_local_tensor = _wrap(orig)
    for name in _USERS:     # imported already (a harness that instruments late)
        user = sys.modules.get(name)
        if user is not None and getattr(user, "redistribute_local_tensor", None) is orig:
            user.redistribute_local_tensor = w


def install() -> None:
    lazy.when_imported(REDISTRIBUTE, _patch, "DTensor redistribution")
