"""The iterations outside a recording window, packed as `run` spans (docs/format.md, "A
windowed recording"): each iteration's start and length to the microsecond, its phase sums
as shares of its length (in 1/PHASE_PER_T of it), Rice-coded.

Why Rice: the numbers of one flush (its lengths, its shares) scatter about a value of their
own, each column about a different one, and the trace's codec (zstd, one table of byte
frequencies for them all) codes each no better than that mixture. On the 2-rank gloo job of
tests/test_window_samples (~10 ms iterations, a loaded 2-core machine), per rank's
iteration, one recording's entries coded anew: JSON lists in microseconds 10.9 bytes; the
same with 1 % shares 6.8, or one character a share 6.7; residuals about each column's own
reference, Rice-coded with the column's own parameter, 4.6 (the lengths' 14 bits the most
of it); 4.8 in a recording of its own."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

# the phase sums an iteration outside the window keeps (ns); forward and backward count
# only the spans of whole passes (layer < 1), not the layers inside them
PHASES = ("io", "h2d", "forward", "backward", "update", "comm")
# a sum beside the phases that an iteration may carry, a time kept to the microsecond like
# its length: the time after its last phase (gputrace.window.phase_sums)
AFTER = "after"
# a phase sum is kept as its share of the iteration's length in 1/PHASE_PER_T
PHASE_PER_T = 100
PHASE_UNIT = f"t/{PHASE_PER_T}"
# what a recording's metadata says of its `run` spans, under `window`, beside what was asked
RUN_KEYS = ("run_phases", "run_unit", "run_phase_unit")


def described() -> dict[str, Any]:
    """The metadata's words for the `run` spans: the phases, in their order; `us`, the unit
    of their times; the phase sums' unit, a share of the iteration's length."""
    return dict(zip(RUN_KEYS, (list(PHASES), "us", PHASE_UNIT), strict=True))


# the order the phases are coded in: comm after backward, which it follows under DDP (a
# column may be coded about the one before it)
_ORDER = ("io", "h2d", "forward", "update", "backward", "comm")
_SUMS, _ZEROS = (*_ORDER, AFTER), (0,) * (len(_ORDER) + 1)
# a residual whose quotient reaches this is written in `big` (a stall far off the
# flush's median: its length exact, whatever it is, at 50 bits in the stream)
_QMAX = 48
_DIGITS = bytes.maketrans(b"\x00\x01", b"01")


def _zigzag(d: np.ndarray) -> np.ndarray:
    return (d << 1) ^ (d >> 63)


def _unzigzag(u: np.ndarray) -> np.ndarray:
    return (u >> 1) ^ -(u & 1)


def _cost(u: np.ndarray) -> tuple[int, int]:
    """(bits, Rice parameter) of the parameter that takes the fewest bits for `u`, every
    parameter up to the one that leaves no quotient tried at once."""
    ks = np.arange(int(u.max()).bit_length() + 1)
    q = u[:, None] >> ks
    bits = np.minimum(q, _QMAX).sum(0) + u.size * (ks + 1) + 64 * (q >= _QMAX).sum(0)
    k = int(np.argmin(bits))
    return int(bits[k]), k


def _expg(x: int) -> str:
    """Exp-Golomb (order 0) of x >= 0: as many zeros as x + 1 has bits less one, then x + 1."""
    b = format(x + 1, "b")
    return "0" * (len(b) - 1) + b


def _rice(u: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A column's bits: every quotient in unary (ones, a zero), then every remainder in k
    bits (so a reader takes them apart with array operations); a quotient of _QMAX or more
    is an escape. Returns the bits and the escaped indices."""
    q = np.minimum(u >> k, _QMAX)
    unary = np.ones(int(q.sum()) + u.size, np.uint8)
    unary[np.cumsum(q + 1) - 1] = 0
    r = np.where(q < _QMAX, u & ((1 << k) - 1), 0)
    rest = ((r[:, None] >> np.arange(k - 1, -1, -1)) & 1).astype(np.uint8).ravel()
    return np.concatenate([unary, rest]), np.flatnonzero(q >= _QMAX)


class _Reader:
    def __init__(self, text: str) -> None:
        self.bits = np.unpackbits(np.frombuffer(base64.b64decode(text), np.uint8))
        self.text = self.bits.tobytes().translate(_DIGITS)    # b"0110...": the few fields
        self.pos = 0

    def fixed(self, w: int) -> int:
        if self.pos + w > len(self.text):
            raise ValueError("run entry: its bits end early")
        self.pos += w
        return int(self.text[self.pos - w:self.pos] or b"0", 2)

    def expg(self) -> int:
        one = self.text.find(b"1", self.pos)
        if one < 0:
            raise ValueError("run entry: its bits end early")
        w, self.pos = one - self.pos + 1, one
        return self.fixed(w) - 1

    def rice(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        zeros = np.flatnonzero(self.bits[self.pos:] == 0)[:n]
        if zeros.size < n:
            raise ValueError("run entry: its bits end early")
        q = zeros.astype(np.int64)
        q[1:] -= zeros[:-1] + 1
        self.pos += int(zeros[-1]) + 1
        if self.pos + n * k > self.bits.size:
            raise ValueError("run entry: its bits end early")
        rest = self.bits[self.pos:self.pos + n * k].reshape(n, k).astype(np.int64)
        self.pos += n * k
        r = rest @ (np.int64(1) << np.arange(k - 1, -1, -1, dtype=np.int64))
        return (q << k) | r, q >= _QMAX


def _predict(mode: int, ref: int, t: np.ndarray, prev: np.ndarray | None,
             per: int = PHASE_PER_T) -> np.ndarray:
    """What a column's values are coded against: `ref` (share: a median), the share `ref`
    microseconds would be of each iteration (us: a phase steady in time while the
    iteration's length varies), or the column before plus `ref` (prev: a phase that
    follows another, as DDP's comm follows backward)."""
    if mode == 1:
        return np.where(t > 0, (2 * ref * per + t) // np.maximum(2 * t, 1), 0)
    if mode == 2 and prev is not None:
        return prev + ref
    return np.full(t.size, ref, np.int64)


def _mid(v: np.ndarray) -> int:
    """A median (the upper one of an even count)."""
    return int(np.partition(v, v.size // 2)[v.size // 2])


def _column(v: np.ndarray, us: np.ndarray | None, t: np.ndarray, prev: np.ndarray | None
            ) -> tuple[int, int, int, int]:
    """(bits, mode, ref, k): the cheapest way to code a column."""
    tries = [(0, _mid(v))]
    if us is not None:
        tries.append((1, _mid(us)))
    if prev is not None:
        tries.append((2, _mid(v - prev)))
    best = None
    for mode, ref in tries:
        bits, k = _cost(_zigzag(v - _predict(mode, ref, t, prev)))
        if best is None or bits < best[0]:
            best = (bits, mode, ref, k)
    assert best is not None
    return best


def pack(folded: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Iterations outside the window, (start, end, name, tid, step, sums in ns), as one `run`
    span per name and thread: from the first one's start to the last one's end, the first
    one's step, and in `args` a JSON object: `n` iterations; `cols`, the columns coded:
    `gap_us` (from the previous one's end, left out where they tile), `t_us` (its length),
    then each phase sum as a share of t_us in 1/`phase_per_t` (left out where 0
    throughout); `rice`, in base64, each column's mode (2 bits), Rice parameter (6 bits) and
    reference (Exp-Golomb, zigzag), then the columns' residuals from what mode and
    reference predict, zigzag- and Rice-coded; `big` [column, index, value] for a value the
    stream escapes; `step` only where the steps do not follow one another. Times are
    rounded from the span's start, so no rounding accumulates."""
    groups: dict[tuple[Any, Any], list[tuple[Any, ...]]] = {}
    for f in sorted(folded, key=lambda f: f[0]):
        groups.setdefault((f[2], f[3]), []).append(f)
    out = []
    for (name, tid), its in groups.items():
        t0, first = its[0][0], its[0][4]
        # ns from the span's start, and each one's sums; microseconds half up
        ns = np.array([[f[0] - t0, f[1] - t0, *map(f[5].get, _SUMS, _ZEROS)] for f in its],
                      np.int64)
        s, e = (ns[:, 0] + 500) // 1000, (ns[:, 1] + 500) // 1000
        t = e - s
        cols: dict[str, np.ndarray] = {
            "gap_us": s - np.concatenate([[0], e[:-1]]), "t_us": t,
            "after_us": (ns[:, -1] + 500) // 1000}
        us: dict[str, np.ndarray] = {}
        for i, p in enumerate(_ORDER):
            us[p] = (ns[:, 2 + i] + 500) // 1000
            # the share of t_us in 1/PHASE_PER_T, half up
            cols[p] = np.where(t > 0, (2 * ns[:, 2 + i] * PHASE_PER_T + t * 1000)
                               // np.maximum(2 * t * 1000, 1), 0)
        names = [c for c in cols if c == "t_us" or cols[c].any()]
        head, body, big = "", [], []
        for j, c in enumerate(names):
            prev = cols[names[j - 1]] if j and names[j - 1] in us and c in us else None
            _, mode, ref, k = _column(cols[c], us.get(c), t, prev)
            head += f"{mode:02b}{k:06b}" + _expg(2 * ref if ref >= 0 else -2 * ref - 1)
            b, esc = _rice(_zigzag(cols[c] - _predict(mode, ref, t, prev)), k)
            body.append(b)
            big.extend([j, int(i), int(cols[c][i])] for i in esc)
        args: dict[str, Any] = {"n": len(its), "phase_per_t": PHASE_PER_T, "cols": names,
                                "rice": base64.b64encode(np.packbits(np.concatenate(
                                    [np.frombuffer(head.encode(), np.uint8) - 48, *body])
                                    ).tobytes()).decode()}
        if big:
            args["big"] = big
        steps = [f[4] for f in its]
        if first is None or steps != list(range(first, first + len(its))):
            args["step"] = steps
        out.append(("run", name, t0, its[-1][1], tid, first, -1, None,
                    json.dumps(args, separators=(",", ":"))))
    return out


def _columns(v: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The columns of a Rice-coded entry (None where it is not one)."""
    n, names = v.get("n"), v.get("cols")
    if not (isinstance(n, int) and n > 0 and isinstance(names, list) and "t_us" in names):
        return None
    rd = _Reader(v.get("rice") or "")
    per = int(v.get("phase_per_t") or PHASE_PER_T)
    head = [(rd.fixed(2), rd.fixed(6), int(_unzigzag(np.array(rd.expg())))) for _ in names]
    big = {(int(j), int(i)): int(x) for j, i, x in v.get("big") or []}
    out: dict[str, np.ndarray] = {}
    for j, (c, (mode, k, ref)) in enumerate(zip(names, head, strict=True)):
        u, esc = rd.rice(n, k)
        prev = out[names[j - 1]] if mode == 2 and j else None
        t = out.get("t_us", np.zeros(n, np.int64))
        col = _unzigzag(u) + _predict(mode, ref, t, prev, per)
        for i in np.flatnonzero(esc).tolist():
            col[i] = big[(j, i)]      # a KeyError where the entry lost it
        out[str(c)] = col
    return out


def unpack(start_ns: int, end_ns: int | None, step: int, args: str | None
           ) -> list[tuple[int, int, int, dict[str, int]]]:
    """A `run` span's iterations: (step, start, end, sums), times in ns, sums for each of
    PHASES and `after`. Reads the Rice-coded entry `pack` writes, the JSON lists of older
    traces (`t_us`, `gap_us`, a phase or `after_us` in microseconds, a list left out read
    as zeros) and a span of one iteration whose `args` is a list of its phase sums
    (microseconds in PHASES' order)."""
    try:
        v = json.loads(args or "[]")
    except ValueError:
        return []
    if isinstance(v, list):
        return [(step, start_ns, end_ns if end_ns is not None else start_ns,
                 {**{p: int(x) * 1000 for p, x in zip(PHASES, v, strict=False)}, AFTER: 0})]
    if not isinstance(v, dict):
        return []
    if isinstance(v.get("t_us"), list):
        return _unpack_lists(start_ns, step, v)
    try:
        cols = _columns(v)
    except (ValueError, TypeError, IndexError, KeyError):
        return []
    if cols is None or "t_us" not in cols:
        return []
    n = int(v["n"])
    t = cols["t_us"]
    gap = cols.get("gap_us", np.zeros(n, np.int64))
    s = np.cumsum(gap) + np.concatenate([[0], np.cumsum(t)[:-1]])
    per = int(v.get("phase_per_t") or PHASE_PER_T)
    sums = {p: (2 * cols[p] * t * 1000 + per) // (2 * per) if p in cols else np.zeros(n, np.int64)
            for p in PHASES}
    sums[AFTER] = cols.get("after_us", np.zeros(n, np.int64)) * 1000
    steps = [int(x) for x in v["step"]] if isinstance(v.get("step"), list) \
        and len(v["step"]) == n else range(step, step + n)
    starts = (start_ns + s * 1000).tolist()
    ends = (start_ns + (s + t) * 1000).tolist()
    keys = list(sums)
    rows = np.stack([sums[p] for p in keys], axis=1).tolist()
    return [(k, a, b, dict(zip(keys, r, strict=True)))
            for k, a, b, r in zip(steps, starts, ends, rows, strict=True)]


def _unpack_lists(start_ns: int, step: int, v: dict[str, Any]
                  ) -> list[tuple[int, int, int, dict[str, int]]]:
    """An entry of JSON lists in microseconds, as traces before the Rice coding hold."""
    out, prev = [], 0
    n = len(v["t_us"])
    cols = {k: v.get(k) if isinstance(v.get(k), list) and len(v[k]) == n else [0] * n
            for k in ("step", "gap_us", *PHASES, "after_us")}
    for i in range(n):
        s = prev + int(cols["gap_us"][i])
        prev = e = s + int(v["t_us"][i])
        out.append((int(cols["step"][i]) if "step" in v else step + i,
                    start_ns + s * 1000, start_ns + e * 1000,
                    {**{p: int(cols[p][i]) * 1000 for p in PHASES},
                     AFTER: int(cols["after_us"][i]) * 1000}))
    return out
