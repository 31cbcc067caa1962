"""The orders of the schedules that hold several stages per rank come from torch's own
schedules (torch.distributed.pipelining, seconds to import) and are kept in the user's
cache per torch release: an analysis that asks for them again, in another process, gets the
same orders without importing torch; a refusal is kept as the same message; a cache that
cannot be written changes nothing but the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ASK = [("ScheduleInterleaved1F1B", 2, 2, 4), ("ScheduleZBVZeroBubble", 2, 2, 3),
       ("ScheduleLoopedBFS", 3, 2, 6), ("ScheduleNoSuch", 2, 2, 4)]
CODE = f"""
import json, sys
from gputrace.analyzers.parallel.pp import pporders
out = []
for args in {ASK!r}:
    try:
        lay = pporders.layout(*args)
        out.append({{"orders": lay.orders, "rank_of": lay.rank_of}})
    except ValueError as e:
        out.append({{"error": str(e)}})
print(json.dumps({{"got": out, "torch": "torch" in sys.modules}}))
"""


def _ask(cache: Path) -> dict:
    env = dict(os.environ, GPUTRACE_CACHE_DIR=str(cache))
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _torchs(schedule: str, p: int, v: int, m: int) -> list[list[str]]:
    """Each rank's actions as torch's schedule lists them, asked here directly."""
    from torch.distributed.pipelining import schedules

    from gputrace.analyzers.parallel.pp.pporders import _Stand, placement

    rank_of = placement(schedule, p, v)
    out = []
    for r in range(p):
        mine = [s for s, q in enumerate(rank_of) if q == r]
        sched = getattr(schedules, schedule)([_Stand(s, len(rank_of), r, p) for s in mine], m,
                                             loss_fn=lambda o, t: o)
        out.append([str(a) for a in sched.pipeline_order[r] if a is not None])
    return out


@pytest.fixture(scope="module")
def asked(tmp_path_factory) -> tuple[dict, dict]:
    """Asked twice of one cache, in two processes."""
    d = tmp_path_factory.mktemp("cache")
    return _ask(d), _ask(d)


def test_orders_asked_again_come_from_the_cache_without_torch(asked):
    first, again = asked
    assert first["torch"] and not again["torch"]
    assert again["got"] == first["got"]
    for (schedule, p, v, m), got in zip(ASK[:-1], first["got"][:-1], strict=True):
        want = _torchs(schedule, p, v, m)
        assert [["".join(map(str, (s, k, i))) for k, s, i in rank] for rank in got["orders"]] \
            == [[a.replace(";", "") for a in rank] for rank in want], schedule
    assert again["got"][-1]["error"].endswith("this torch has no ScheduleNoSuch")


def test_an_unwritable_cache_changes_nothing_but_the_time(asked, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert _ask(blocked / "cache") == asked[0]
    assert not list(tmp_path.glob("**/*.tmp"))


def test_a_damaged_cache_is_computed_again(asked, tmp_path):
    (tmp_path / "pipeline-orders.json").write_text('{"half')
    assert _ask(tmp_path) == asked[0]
