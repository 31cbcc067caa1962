"""analyzers.extras.hangs on `flight` rows laid out as the comm collector writes them, for what the
2-rank job of test_hangs cannot show: a group of 3 where two wait, a rank with no record, a
slow collective every rank waited in alike (no rank waited for), a straggler that waited a
little too."""

from __future__ import annotations

import json

from gputrace.analyzers.extras import hangs

S = 10**9
G = {"size": 3, "ranks": [0, 1, 2], "name": "0", "desc": "default_pg"}


def state(rank: int, t: float, seq: int, done: int, open_: list) -> dict:
    return {"kind": "instant", "cat": "flight", "name": "state", "rank": rank,
            "start_ns": int(t * S), "args": json.dumps(
                {"group": G, "seq": seq, "done": done, "in_flight": len(open_),
                 "open": [[q, k, int(t0 * S), st] for q, k, t0, st in open_]})}


def waited(rank: int, t0: float, t1: float, seq: int) -> dict:
    return {"kind": "instant", "cat": "flight", "name": "waited", "rank": rank,
            "start_ns": int(t1 * S), "args": json.dumps(
                {"group": G, "seq": seq, "kind": "all_reduce", "entered_ns": int(t0 * S),
                 "step": 3})}


def test_two_wait_in_flight_for_the_third():
    rows = [state(0, 7, 5, 4, [(5, "all_reduce", 1, 3)]),
            state(1, 7, 5, 4, [(5, "all_reduce", 1.5, 3)]),
            state(2, 3, 4, 4, []), state(2, 6, 4, 4, [])]
    (h,) = hangs.find(rows)
    assert h.ongoing and h.late == (2,) and h.late_at == {2: 4} and h.unknown == ()
    assert h.waited_s == {0: 6.0, 1: 5.5} and (h.kind, h.seq, h.step) == ("all_reduce", 5, 3)
    assert hangs.message(h).startswith("rank 2 has not arrived at all_reduce seq 5")
    # under the threshold: none
    assert hangs.find(rows, threshold_s=6.5) == []


def test_a_rank_without_any_record_is_unknown_not_late():
    rows = [state(0, 7, 1, 0, [(1, "barrier", 1, 0)]), state(1, 7, 1, 0, [(1, "barrier", 1, 0)])]
    (h,) = hangs.find(rows)
    assert h.late == () and h.unknown == (2,) and h.ongoing
    assert hangs.message(h).startswith("rank 2 of the group left no record of barrier seq 1")


def test_ended_waits_name_the_rank_that_did_not_wait():
    rows = [waited(0, 1, 9, 5), waited(1, 1.5, 9, 5), state(2, 9, 5, 5, [])]
    (h,) = hangs.find(rows)
    assert not h.ongoing and h.late == (2,) and h.waited_s == {0: 8.0, 1: 7.5}
    assert "rank 2 arrived last at all_reduce seq 5" in hangs.message(h)


def test_a_slow_collective_every_rank_waited_in_alike_is_no_hang():
    assert hangs.find([waited(0, 1, 9, 5), waited(1, 1, 9, 5), waited(2, 1.2, 9, 5)]) == []


def test_a_straggler_that_waited_a_little_is_the_one_waited_for():
    (h,) = hangs.find([waited(0, 1, 9, 5), waited(1, 1, 9, 5), waited(2, 7, 9, 5)])
    assert h.late == (2,) and h.waited_s == {0: 8.0, 1: 8.0}
