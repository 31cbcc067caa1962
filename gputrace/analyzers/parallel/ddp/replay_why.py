"""Why the what-if replay gives no figure: nothing to replay in the run (no comm measured, no
bytes, too few bytes to fit a cost on), a replay of the measured configuration that does not
land on the measurement, or a scenario the run cannot tell (bucket sizes without per-layer
gradients, a faster link where no link bandwidth is known). Each is one sentence a user can
act on."""

from __future__ import annotations

import numpy as np

from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.findings.sanity import fit_too_small
from gputrace.analyzers.parallel.ddp.replay_inputs import units_in_iterations
from gputrace.analyzers.parallel.ddp.replay_sim import CommCost

BASELINE_TOL = 0.05     # the replay of the measured run against its iteration
FIX = "give the link's bandwidth (--link-bandwidth, or `gputrace probe` before recording)"


def why_no_replay(rs: RankSteps, sel: np.ndarray, world: int,
                  link_bytes_per_s: float | None) -> str:
    """Why `replay` had nothing to replay, in words a user can act on."""
    if not sel.size:
        return "no iterations to replay (the trace has no complete iteration past warm-up)"
    rows, _, begin, end, nb = units_in_iterations(rs, sel)
    if not rows.size:
        return ("no gradient comm was measured in the analyzed iterations (no all-reduce "
                f"units) and no link bandwidth is known: {FIX}")
    if np.isnan(nb).all() and link_bytes_per_s and not sum(rs.layer_bytes.values()):
        return ("neither the comm units nor the layers carry byte counts (the trace does not "
                "say how much each collective moved or each gradient holds): the replay has "
                "no bytes to move over the link")
    if np.isnan(nb).all():
        return ("the comm units carry no byte counts (the trace does not say how much each "
                f"collective moved), so no comm cost can be fitted from them: {FIX}")
    if not (end > begin).any():
        return f"the comm units have no duration to fit a cost to: {FIX}"
    small = too_small(rs, sel) if world > 1 else None
    if small:
        return small
    return f"the comm of {world} rank(s) could not be fitted: {FIX}"


def too_small(rs: RankSteps, sel: np.ndarray) -> str | None:
    """Why the measured units are too few bytes to fit a cost per byte on, or None."""
    _, _, _, _, nb = units_in_iterations(rs, sel)
    return fit_too_small(float(np.nansum(nb)) / max(sel.size, 1))


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def baseline_off(measured_t_iter: float, baseline_t_iter: float) -> str | None:
    """Why the replay's predictions are withheld: its replay of the measured configuration
    misses the measured iteration by more than BASELINE_TOL (its changes would be a
    model's, not the run's); None when it lands."""
    if not measured_t_iter > 0:
        return None
    err = baseline_t_iter / measured_t_iter - 1
    if abs(err) <= BASELINE_TOL:
        return None
    return (f"the replay of the measured configuration gives {_ms(baseline_t_iter)} per "
            f"iteration against the measured {_ms(measured_t_iter)} ({err:+.1%}, over "
            f"{BASELINE_TOL:.0%}): it does not reproduce this run, so what it predicts for "
            "other configurations is not given")


def scenario_unknown(bucket_bytes: float | None, bandwidth_x: float, layers_known: bool,
                     cost: CommCost) -> str | None:
    """Why a scenario cannot be told from this run, or None."""
    if bucket_bytes is not None and not layers_known:
        return ("bucket sizes are not replayed: the trace has no per-layer gradient bytes "
                "and ready times (its comm units carry no layers), so no other bucketing "
                "of the gradients can be built")
    if bandwidth_x > 1 and cost.cpu_s_per_byte > 0 and not cost.wire_bytes_per_s:
        return ("a faster link is not predicted: no link bandwidth is known, so the measured "
                "comm's rate stands for both the host's CPU and the link, and what held it "
                f"back cannot be told (a slower link would lengthen it): {FIX}")
    return None
