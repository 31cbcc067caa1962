"""Host clock offsets from the comm units every rank ends at once (analyzers.core.clocks),
where one host's ranks are delayed more than the other's: each recorded end is late by a
delay of its own host's, never early, so the median of the differences leans toward the
more delayed host, and the stated uncertainty must cover that lean, not only the median's
standard error (a 4-rank torchrun job on 2 busy cores: the median 3.5 ms off the applied
skew where its standard error said 0.7 ms)."""

from __future__ import annotations

import numpy as np

from gputrace.analyzers.core import clocks

THETA_NS = 25_000_000


def _ranks(seed: int, heavy_ms: float) -> dict[int, tuple[str, clocks.UnitTimes]]:
    """Two hosts of two ranks, 60 units: every unit ends at one true instant; host A's ends
    late by a fraction of a millisecond, host B's (clock THETA ahead) by as much on most
    units and by `heavy_ms` on average on two in five (its ranks waiting for a core)."""
    rng = np.random.default_rng(seed)
    n = 60
    true_end = np.cumsum(rng.uniform(5e6, 9e6, n)).astype(np.int64)
    start = true_end - 2_000_000
    out = {}
    for r, host in enumerate(("A", "A", "B", "B")):
        delay = rng.exponential(0.15e6, n)
        if host == "B":
            delay += np.where(rng.random(n) < 0.4, rng.exponential(heavy_ms * 1e6, n), 0.0)
        shift = THETA_NS if host == "B" else 0
        out[r] = (host, clocks.UnitTimes(np.arange(n), np.zeros(n, np.int64),
                                         start + shift, true_end + shift +
                                         delay.astype(np.int64)))
    return out


def test_the_offsets_uncertainty_covers_one_hosts_heavier_delays():
    missed_by_se = 0
    for seed in range(20):
        c = clocks.estimate(_ranks(seed, 6.0))
        b = c.hosts["B"]
        err = abs(b.offset_s - THETA_NS / 1e9)
        assert err <= 3 * b.uncertainty_s, (seed, err, b)
        se = 1.2533 * b.spread_s / np.sqrt(b.matched)
        missed_by_se += err > 3 * se
    assert missed_by_se > 0     # the standard error alone would have said too little


def test_equal_delays_keep_the_uncertainty_the_medians_standard_error():
    c = clocks.estimate(_ranks(1, 0.0))
    b = c.hosts["B"]
    assert abs(b.offset_s - THETA_NS / 1e9) < 1e-3
    assert b.uncertainty_s < 1e-3
