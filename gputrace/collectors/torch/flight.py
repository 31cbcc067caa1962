"""Where this process stands in each process group's collectives, keyed as PyTorch's Flight
Recorder keys its entries: the group and a sequence number of the collectives issued on it
(c10d's `collective_seq_id`, counted here per group and process, point-to-point calls apart).

The comm collector calls `enter` before a collective runs and `leave` when it ended (a
synchronous call's return, an asynchronous one's completion or wait). At each flush the
recorder writes, per group, one `flight`/`state` instant (docs/format.md): the last sequence
number entered and ended, and the collectives entered and not ended, oldest first (the
default group's from init_process_group's return on, seq 0 before its first); written
when it changed, while something is in flight, at the recording's end, and every
HEARTBEAT_NS else (a rank that sleeps still says where it stands). A collective that took
LONG_NS or more leaves a `flight`/`waited` instant at its end, with its entry. Instants survive a
recording window's folding, so a trace read while the job runs (`gputrace capture`), one
recovered after a kill and one finished all hold them (analyzers.extras.hangs reads them).
"""

from __future__ import annotations

import json
from typing import Any

from gputrace.collectors.torch.comm_args import _c10d, _group_json

LONG_NS = 1_000_000_000
HEARTBEAT_NS = 2_000_000_000
_OPEN_SHOWN = 4          # in-flight collectives a state row lists (the oldest)
P2P = frozenset(("send_recv", "batch"))


class _Group:
    __slots__ = ("json", "seq", "done", "open", "said", "said_ns")

    def __init__(self, gjson: str) -> None:
        self.json = gjson
        self.seq = 0          # the last sequence number entered (1, 2, ...)
        self.done = 0         # the highest one ended
        self.open: dict[int, tuple[str, int, int]] = {}   # seq -> (kind, entered ns, step)
        self.said: tuple[int, int] = (0, 0)
        self.said_ns = 0


_groups: dict[Any, _Group] = {}
_ended: list[tuple[str, int, str, int, int, int]] = []   # long ones since the last flush
_hooked: list[Any] = [None]   # the recorder whose flushes write the rows


def enter(rec: Any, kind: str, group: Any, t0: int) -> tuple[_Group, int] | None:
    """A collective of `kind` on `group` (None: the default group) begins at t0: its token
    for `leave`, None for a point-to-point call (ranks do not issue the same ones)."""
    if kind in P2P:
        return None
    if group is None:
        group = _c10d[0]._world.default_pg
    g = _groups.get(group) or _join(rec, group)
    # no lock: a group's collectives are issued in one order (c10d requires it), and a
    # dict's item set and pop are atomic; the flusher copies what it reads
    g.seq = seq = g.seq + 1
    # its iteration; -1 before the first (none begun yet: start-up's collectives)
    step = -1 if rec.step == 0 and rec._iter_start is None else rec.step
    g.open[seq] = (kind, t0, step)
    return g, seq


def _join(rec: Any, group: Any) -> _Group:
    g = _groups[group] = _Group(_group_json(group))
    if _hooked[0] is not rec:
        _hooked[0] = rec
        rec.flush_hooks.append(_flush)
    return g


def joined(rec: Any, group: Any) -> None:
    """This process is in `group` (the default one, from init_process_group's return): its
    state is written from now on, seq 0 before its first collective, so that a rank that
    has issued none yet (asleep in its start-up) still says where it stands."""
    if _c10d[0] is not None and group is not None and group not in _groups:
        _join(rec, group)


def leave(token: tuple[_Group, int] | None, t1: int) -> None:
    """The collective `token` ended at t1 (called once or more: the first counts)."""
    if token is None:
        return
    g, seq = token
    entry = g.open.pop(seq, None)
    if entry is None:
        return
    if seq > g.done:
        g.done = seq
    kind, t0, step = entry
    if t1 - t0 >= LONG_NS:
        _ended.append((g.json, seq, kind, t0, t1, step))


def _flush(spans: list[Any], closing: bool) -> list[tuple[Any, ...]]:
    rec = _hooked[0]
    if rec is None:
        return []
    now = rec.clock.now_ns()
    out = []
    ended = [_ended.pop(0) for _ in range(len(_ended))]
    states = []
    for g in list(_groups.values()):
        mark = (g.seq, g.done)
        open_ = _items(g.open)
        if not (open_ or closing or mark != g.said or now - g.said_ns >= HEARTBEAT_NS):
            continue
        g.said, g.said_ns = mark, now
        shown = sorted(open_)[:_OPEN_SHOWN]
        states.append((g.json, mark[0], mark[1], len(open_),
                       [[s, k, t, st] for s, (k, t, st) in shown]))
    for gj, seq, done, n_open, shown in states:
        args = (f'{{"group":{gj},"seq":{seq},"done":{done},"in_flight":{n_open},'
                f'"open":{json.dumps(shown)}}}')
        out.append(_row(rec, "state", now, -1, args))
    for gj, seq, kind, t0, t1, step in ended:
        args = (f'{{"group":{gj},"seq":{seq},"kind":"{kind}","entered_ns":{t0},'
                f'"step":{step}}}')
        out.append(_row(rec, "waited", t1, step, args))
    return out


def _items(d: dict[int, Any]) -> list[tuple[int, Any]]:
    for _ in range(8):
        try:
            return list(d.items())
        except RuntimeError:   # changed while copied: again
            continue
    return []


def _row(rec: Any, name: str, t: int, step: int, args: str) -> tuple[Any, ...]:
    """An instant as Recorder.row lays it out."""
    return ("instant", "flight", name, t, None, None, None, rec.host, rec.rank, rec.pid, -1,
            -1, -1, step, -1, None, None, None, None, args)
