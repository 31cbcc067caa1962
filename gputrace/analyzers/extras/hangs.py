"""Collectives that some rank waited in for longer than THRESHOLD_S, with the ranks that had
not arrived: from the `flight` instants each rank's comm collector writes (docs/format.md),
keyed as PyTorch's Flight Recorder keys its entries, by process group and sequence number.

A collective ends on every rank once the last one arrives, so a rank's own time in it is the
time it waited for the others, on its own clock (no clock across hosts is needed): the ranks
of the group that did not wait (under the collector's LONG_NS, or the least) are the ones
the others waited for. One still in flight where the trace ends (read while the job runs,
recovered after a kill, or a job that ended inside it) names the ranks whose last record
says they had not entered it, and the wait so far, as of that record.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

THRESHOLD_S = 5.0
# a rank that waited no more than this over the least wait of the group arrived last too
# (the collector writes a wait of 1 s or more: under it, a rank did not wait)
LAST_S = 1.0
COLUMNS = ("kind", "cat", "name", "rank", "start_ns", "args")


@dataclass(frozen=True)
class Hang:
    """One collective (a group's sequence number) that some rank waited in too long."""

    group: str                     # the process group's name (c10d's group_name)
    desc: str | None               # its description (e.g. default_pg, mesh_tp)
    members: tuple[int, ...]       # its ranks (global), where known
    kind: str                      # all_reduce, all_gather, barrier, ...
    seq: int                       # its number in the group's sequence, from 1
    step: int                      # the iteration the first waiter entered it in
    waited_s: dict[int, float]     # per rank that waited: how long (so far, if ongoing)
    late: tuple[int, ...]          # the ranks the others waited for (had not arrived)
    unknown: tuple[int, ...]       # ranks of the group with no record of it
    ongoing: bool                  # a rank was still in it at its last record
    entered_ns: int                # the first waiter's entry (trace clock)
    late_at: dict[int, int]        # ongoing: each late rank's last sequence number entered
    as_of_ns: int                  # the last record of the longest wait (trace clock)

    @property
    def longest(self) -> tuple[int, float]:
        r = max(self.waited_s, key=lambda k: self.waited_s[k])
        return r, self.waited_s[r]

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "group_desc": self.desc, "group_ranks": list(self.members),
                "kind": self.kind, "seq": self.seq, "step": self.step,
                "ongoing": self.ongoing, "late_ranks": list(self.late),
                "unknown_ranks": list(self.unknown),
                "waited_s": {str(r): s for r, s in sorted(self.waited_s.items())},
                "late_last_seq": {str(r): s for r, s in sorted(self.late_at.items())},
                "entered_unix_s": self.entered_ns / 1e9, "as_of_unix_s": self.as_of_ns / 1e9,
                "message": message(self)}


def rows_of(table: pa.Table | None) -> list[dict[str, Any]]:
    """The `flight` instants of a trace's table (empty where it has none)."""
    if table is None or any(c not in table.column_names for c in COLUMNS):
        return []
    m = pc.and_(pc.equal(table["kind"], "instant"),
                pc.equal(table["cat"].cast(pa.string()), "flight"))
    return table.filter(m).select(list(COLUMNS)).to_pylist()


def find(rows: Iterable[dict[str, Any]], threshold_s: float = THRESHOLD_S) -> list[Hang]:
    """The collectives some rank waited in for threshold_s or more, first entered first."""
    waited: dict[tuple[str, int], dict[int, tuple[str, int, int, int]]] = {}
    last: dict[tuple[int, str], tuple[int, dict[str, Any]]] = {}   # (rank, group) -> state
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        try:
            a = json.loads(r["args"] or "{}")
            g = a["group"]
            name = str(g.get("name", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        groups.setdefault(name, g)
        rank, t = int(r["rank"]), int(r["start_ns"])
        if r["name"] == "waited":
            waited.setdefault((name, int(a["seq"])), {})[rank] = (
                str(a.get("kind")), int(a["entered_ns"]), t, int(a.get("step", -1)))
        elif r["name"] == "state":
            prev = last.get((rank, name))
            if prev is None or t >= prev[0]:
                last[(rank, name)] = (t, a)
    cands: dict[tuple[str, int], dict[int, tuple[str, int, int, int, bool]]] = {}
    for key, by_rank in waited.items():
        for rank, (kind, t0, t1, step) in by_rank.items():
            cands.setdefault(key, {})[rank] = (kind, t0, t1, step, False)
    for (rank, name), (t, a) in last.items():
        for seq, kind, t0, step in a.get("open") or []:
            if (name, seq) in waited and rank in waited[(name, seq)]:
                continue                         # it ended after this record
            cands.setdefault((name, int(seq)), {})[rank] = (str(kind), int(t0), t, int(step),
                                                            True)
    out = []
    for (name, seq), by_rank in cands.items():
        h = _hang(name, seq, by_rank, groups[name], last, threshold_s)
        if h is not None:
            out.append(h)
    return sorted(out, key=lambda h: (h.entered_ns, h.group, h.seq))


def _hang(name: str, seq: int, by_rank: dict[int, tuple[str, int, int, int, bool]],
          g: dict[str, Any], last: dict[tuple[int, str], tuple[int, dict[str, Any]]],
          threshold_s: float) -> Hang | None:
    waits = {r: (t1 - t0) / 1e9 for r, (_, t0, t1, _, _) in by_rank.items()}
    if max(waits.values()) < threshold_s:
        return None
    members = tuple(g.get("ranks") or sorted({r for r, n in last if n == name} | set(waits)))
    ongoing = any(v[4] for v in by_rank.values())
    seen = {r for r, n in last if n == name}
    late: list[int] = []
    late_at: dict[int, int] = {}
    unknown = []
    for r in members:
        if r in waits:
            continue
        if r not in seen:
            unknown.append(r)
            continue
        entered = int(last[(r, name)][1].get("seq", 0))
        if ongoing and entered >= seq:
            continue      # it entered it, after its last record of a wait: not waited for
        late.append(r)
        if ongoing:
            late_at[r] = entered
    if not late and not unknown and not ongoing:   # all waited: the last to arrive waited least
        least = min(waits.values())
        late = [r for r in members if r in waits and waits[r] <= least + LAST_S]
    waiting = {r: s for r, s in waits.items() if r not in late}
    if not waiting or max(waiting.values()) < threshold_s:
        return None
    first = min(by_rank.values(), key=lambda v: v[1])
    longest = max(waiting, key=lambda r: waiting[r])
    return Hang(name, g.get("desc"), members, first[0], seq, first[3], waiting, tuple(late),
                tuple(unknown), ongoing, first[1], late_at, by_rank[longest][2])


def _ranks(rs: Iterable[int]) -> str:
    rs = list(rs)
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"


def message(h: Hang) -> str:
    """One line: who had not arrived, at which collective, and how long the others waited."""
    where = (f"{h.kind} seq {h.seq} of group {h.group}"
             + (f" ({h.desc})" if h.desc else "")
             + (f", step {h.step}" if h.step >= 0 else ", before the first step"))
    r, s = h.longest
    more = (f" ({_ranks(sorted(h.waited_s))} {'waiting' if h.ongoing else 'waited'})"
            if len(h.waited_s) > 1 else "")
    if h.ongoing:
        if h.late:
            head = f"{_ranks(h.late)} {'has' if len(h.late) == 1 else 'have'} not arrived at "
        elif h.unknown:
            head = f"{_ranks(h.unknown)} of the group left no record of "
        else:
            head = "every rank of the group entered and none has left "
        text = f"{head}{where}: rank {r} has waited {s:.2f} s in it so far{more}"
        if h.late_at:
            text += "; last entered on the group: " + ", ".join(
                f"rank {k} seq {v}" for k, v in sorted(h.late_at.items()))
    else:
        text = (f"{_ranks(h.late)} arrived last at {where}: rank {r} waited {s:.2f} s for "
                f"{'it' if len(h.late) == 1 else 'them'}{more}") if h.late else \
            f"{where}: rank {r} waited {s:.2f} s{more}"
    if h.unknown and (h.late or not h.ongoing):
        text += f"; {_ranks(h.unknown)} of the group left no record of it"
    return text


def as_json(hangs: list[Hang], threshold_s: float = THRESHOLD_S) -> dict[str, Any]:
    """`hangs` of analyze --json and capture --json."""
    return {"threshold_s": threshold_s, "collectives": [h.as_dict() for h in hangs]}
