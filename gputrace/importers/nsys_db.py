"""An Nsight Systems SQLite export as the importer reads it: its tables and columns checked,
queries read 65536 rows at a time as columns, and the checked readers of their values."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from typing import Any

import numpy as np

from gputrace.importers.common import ImportFailed


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


class Db:
    def __init__(self, path: str) -> None:
        try:
            self.c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            self.tables = {r[0] for r in self.c.execute(
                "SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as e:
            raise ImportFailed(f"not an SQLite database ({e})") from None

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.c.execute(f"PRAGMA table_info({table})")}

    def rows(self, sql: str, *params: Any) -> Any:
        try:
            yield from self.c.execute(sql, params)
        except sqlite3.DatabaseError as e:
            raise ImportFailed(f"unreadable Nsight Systems table ({e})") from None


def need(db: Db, table: str, cols: set[str]) -> bool:
    if table not in db.tables:
        return False
    missing = cols - db.columns(table)
    if missing:
        raise ImportFailed(f"table {table} lacks column(s) {', '.join(sorted(missing))}; "
                           "an unsupported Nsight Systems export")
    return True


def small(v: Any) -> int:
    """A device or stream id; unset ones are stored as 0xFFFFFFFF or NULL."""
    return v if isinstance(v, int) and 0 <= v < 2**15 else -1


def as_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ImportFailed(f"{what} is {v!r}, not an integer")
    return v


_BATCH = 1 << 16


def batches(db: Db, sql: str) -> Iterator[list[Any]]:
    """The rows of a query as columns (a list each), 65536 rows at a time."""
    try:
        cur = db.c.execute(sql)
        while batch := cur.fetchmany(_BATCH):
            yield [list(c) for c in zip(*batch, strict=True)]
    except sqlite3.DatabaseError as e:
        raise ImportFailed(f"unreadable Nsight Systems table ({e})") from None


def ints(vals: list[Any], what: str) -> np.ndarray:
    """`as_int` of each value, as int64: the first that is not an integer is refused."""
    if set(map(type, vals)) <= {int}:
        try:
            return np.array(vals, np.int64)
        except OverflowError:
            pass
    for v in vals:
        if type(v) is not int or not -2**63 <= v < 2**63:
            as_int(v, what)
            raise ImportFailed(f"{what} is {v!r}, out of range")
    return np.array(vals, np.int64)


def smalls(vals: list[Any]) -> np.ndarray:
    """`small` of each value, as int64."""
    if set(map(type, vals)) <= {int}:
        try:
            a = np.array(vals, np.int64)
        except OverflowError:
            pass
        else:
            a[(a < 0) | (a >= 2**15)] = -1
            return a
    return np.fromiter(map(small, vals), np.int64, len(vals))


def ids(vals: list[Any], what: str) -> np.ndarray:
    """Global process or thread ids (NULL: 0) as int64."""
    return ints([0 if v is None else v for v in vals], what)
