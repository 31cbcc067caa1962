"""The pipeline's bubble on one stage: inside each schedule step, the time the stage
computed nothing (no forward, backward or loss of a microbatch, no update: DeepSpeed's
engine steps its optimizer inside train_batch) and stood in no other collective: its waits
for its neighbours and the schedule's own work between microbatches (a microbatch's pass,
the schedule's work around its module or autograd included, is the stage's forward or
backward).
It joins the stage's pipeline term (`t_pp`) beside its p2p waits."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.frame import Spans


def _u(sp: Spans, mask: np.ndarray) -> ov.Union:
    i = np.flatnonzero(mask)
    return ov.union(sp.start[i], sp.end[i])


def passes(sp: Spans) -> tuple[np.ndarray, np.ndarray]:
    """The masks of a pipeline's forward and backward passes (host `pipeline` spans of its
    microbatches: the module's forward or the autograd backward with the schedule's own
    work around it, an instruction of DeepSpeed's engine or a chunk of torch's stage):
    the stage computing that microbatch, so its forward and backward, never the bubble."""
    pipe = sp.of("pipeline") & (sp.device < 0)
    if not pipe.any():
        none = np.zeros(sp.start.size, bool)
        return none, none

    def named(*names: str) -> np.ndarray:
        return np.isin(sp.name, [sp.names.index(n) for n in names if n in sp.names])

    return pipe & named("forward"), pipe & named("backward", "backward_weight")


def with_bubble(sp: Spans, par: dict[str, ov.Union],
                pass_masks: tuple[np.ndarray, np.ndarray]) -> dict[str, ov.Union]:
    """`par`, its pipeline term (`pp`) holding the bubble too: inside each schedule step,
    the time the stage computed nothing (no forward, backward or loss of a microbatch, no
    update) and was in no other collective: its waits for its neighbours and the schedule's
    own work between microbatches. `pass_masks`: passes(sp), which the caller also reads."""
    pipe = sp.of("pipeline")
    if not pipe.any():
        return par
    step = sp.name == (sp.names.index("step") if "step" in sp.names else -2)
    steps = _u(sp, pipe & step)
    host = sp.device < 0
    # comm spans the data-parallel model does not read are `collective` here (for_model)
    comm = (sp.of("comm") | sp.of("collective")) & host
    pf, pb = pass_masks
    busy = ov.merge(_u(sp, (sp.of("forward") | sp.of("backward") | sp.of("update")) & host
                       | pf | pb),
                    _u(sp, comm & ~np.isin(np.arange(sp.start.size), _pp_rows(sp))))
    bubble = ov.subtract(steps, busy)
    out = dict(par)
    out["pp"] = ov.merge(bubble, par["pp"]) if "pp" in par else bubble
    return out


def _pp_rows(sp: Spans) -> np.ndarray:
    """The comm spans that go between pipeline stages (args.pp)."""
    comm = np.flatnonzero(sp.of("comm") | sp.of("collective"))
    if not comm.size:
        return comm
    args = sp.args.take(pa.array(comm)).to_pylist()
    return comm[np.array(['"pp":' in (a or "") for a in args], bool)]


