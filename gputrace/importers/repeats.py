"""Iterations of a trace without iteration marks, from what it repeats: the sequence of the
training loop's top-level ranges (autograd's `emit_nvtx` op ranges, NCCL's calls, the
user's own ranges) or of its kernels."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

_DIGITS = re.compile(r"\d+")
_MAX_CANDIDATES = 200
_MIN_REPEATS = 3          # anchors: at least two whole repeats between them
_SIMILAR = 0.9            # each repeat holds the same names as the median one, to 90 %
_COVER = 0.5              # the repeats cover at least half the thread's time


@dataclass(frozen=True)
class Repeats:
    start: np.ndarray     # ns, each repeat's first range's start
    end: np.ndarray       # ns, the next repeat's start (the last anchor opens no repeat)
    anchor: str           # the name each repeat begins with

    @property
    def period_ns(self) -> float:
        return float(np.median(self.end - self.start))


def top_level(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Indices (in start order) of the ranges no earlier range encloses."""
    order = np.lexsort((-end, start))
    keep = np.ones(order.size, dtype=bool)
    if order.size:
        reach = np.maximum.accumulate(end[order])
        keep[1:] = start[order][1:] >= reach[:-1]
    return order[keep]


def find(names: list[str], start: np.ndarray, end: np.ndarray) -> Repeats | None:
    """The longest sequence the ranges (one thread's, in time order, top-level) repeat at
    least twice over, cut where its first range begins; None where nothing repeats.

    Names are read as they are first (several training steps: a layer's range named by its
    index recurs once per step), then with their numbers blanked (one pass over numbered
    layers: the layer is what repeats). The cut is the name whose occurrences cut the
    thread into like repeats covering most of it: a name other than a single ATen op's
    first, then the one recurring the fewest times, then the earliest."""
    if len(names) < 2 * _MIN_REPEATS:
        return None
    span = float(end.max() - start.min()) or 1.0
    for blank in (False, True):
        seq = [_DIGITS.sub("#", n) for n in names] if blank else list(names)
        codes: dict[str, int] = {}
        arr = np.fromiter((codes.setdefault(n, len(codes)) for n in seq), np.int64, len(seq))
        counts = np.bincount(arr)
        first = np.full(counts.size, len(seq))
        np.minimum.at(first, arr, np.arange(len(seq)))
        cand = np.flatnonzero(counts >= _MIN_REPEATS)
        rev = {v: k for k, v in codes.items()}
        cand = sorted(cand.tolist(), key=lambda c: (rev[c].startswith("aten::"), counts[c],
                                                    first[c]))[:_MAX_CANDIDATES]
        for c in cand:
            at = np.flatnonzero(arr == c)
            if float(start[at[-1]] - start[at[0]]) < _COVER * span:
                continue
            if _alike([arr[a:b] for a, b in zip(at[:-1], at[1:], strict=True)]):
                return Repeats(start[at[:-1]], start[at[1:]], rev[c])
    return None


def _alike(parts: list[np.ndarray]) -> bool:
    """Whether the pieces hold the same names as their median-long one, each to 90 %."""
    lens = np.array([p.size for p in parts])
    ref_i = int(np.argsort(lens)[lens.size // 2])
    ref = Counter(parts[ref_i].tolist())
    for p in parts:
        got = Counter(p.tolist())
        same = sum(min(v, ref.get(k, 0)) for k, v in got.items())
        if same < _SIMILAR * max(p.size, lens[ref_i]):
            return False
    return True


# kernels only a training step runs: a backward pass's or an optimizer's
_TRAINING_KERNEL = re.compile(r"backward|bwd|dgrad|wgrad|multi_tensor_apply|adam|adagrad|"
                              r"sgd|optimizer", re.IGNORECASE)


def kernel_steps(names: list[str], start: np.ndarray, end: np.ndarray
                 ) -> tuple[Repeats | None, str]:
    """The training steps of one GPU stream's kernels (in start order): the longest sequence
    they repeat (see `find`), taken as steps only where every repeat runs a kernel of a
    backward pass or an optimizer. Returns (the repeats, '') or (None, why not)."""
    rep = find(names, start, end)
    if rep is None:
        return None, f"its {len(names)} kernels do not repeat"
    seen: dict[str, bool] = {}
    train = np.fromiter((seen.setdefault(n, bool(_TRAINING_KERNEL.search(n))) for n in names),
                        bool, len(names))
    lo, hi = np.searchsorted(start, rep.start), np.searchsorted(start, rep.end)
    n_train = sum(bool(train[a:b].any()) for a, b in zip(lo.tolist(), hi.tolist(), strict=True))
    if n_train == len(rep.start):
        return rep, ""
    anchor = rep.anchor if len(rep.anchor) <= 60 else rep.anchor[:57] + "..."
    some = "none" if not n_train else f"only {n_train}"
    return None, (f"its kernels repeat {len(rep.start)} times (median "
                  f"{rep.period_ns / 1e6:.1f} ms, from '{anchor}'), but {some} of the repeats "
                  "run a backward or optimizer kernel: a layer or a forward pass, not a "
                  "training step")
