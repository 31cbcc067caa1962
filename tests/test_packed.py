"""A rank's per-iteration summary held packed while the other ranks are analyzed
(analyzers.run.packed): unpacked, every array is the one analyzed, bit for bit, with its
dtype, shape and NaNs, and writable; packed, a synthetic rank of the 1e8-event benchmark's
shape is held in under a sixth of its pickled size. Each trace is analyzed as the command
analyzes it (its frames, each rank's part)."""

from __future__ import annotations

import dataclasses
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from gputrace import load
from gputrace.analysis.inputs import load_inputs
from gputrace.analyzers.run import packed
from gputrace.analyzers.run.rank_part import Options, analyze_frame, analyze_spans
from gputrace.analyzers.run.reading import _frames

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import synth  # noqa: E402

OPTS = Options(None, (2, 4, 8), None, False, (), False, 2)


def _leaves(x, path="steps"):
    """Every array and plain value under a dataclass, dict, list or tuple, with its path."""
    if dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from _leaves(getattr(x, f.name), f"{path}.{f.name}")
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def _same(a, b) -> None:
    la, lb = list(_leaves(a)), list(_leaves(b))
    assert [p for p, _ in la] == [p for p, _ in lb]
    arrays = 0
    for (p, x), (_, y) in zip(la, lb, strict=True):
        if isinstance(x, np.ndarray):
            arrays += 1
            assert x.dtype == y.dtype and x.shape == y.shape, p
            assert x.tobytes() == y.tobytes(), p          # NaNs and -0.0 included
            assert y.size == 0 or y.flags.writeable, p
        else:
            assert x == y or (x != x and y != y), p
    assert arrays >= 20


def _steps(path: Path):
    """Each rank's steps as its analysis made them, before any packing."""
    for f in _frames(load_inputs([str(path)], quiet=True), False):
        for r in list(f.ranks):
            yield analyze_spans(f.ranks[r], OPTS).kept_steps


def test_a_synthetic_rank_comes_back_bit_for_bit_in_under_a_sixth(tmp_path):
    path = tmp_path / "run.arrow"
    synth.write_arrow(path, 2 * 97_656, ranks=2)      # the benchmark's 1e5 events a rank
    n = 0
    for steps in _steps(path):
        held = packed.pack(steps)
        assert steps.units.start.size > 1000
        whole = len(pickle.dumps(steps, protocol=5))
        assert held.nbytes < whole / 6, (held.nbytes, whole)
        _same(steps, held.unpack())
        n += 1
    assert n == 2
    # the command holds its ranks' parts packed
    for f in _frames(load(str(path)), False):
        assert all(isinstance(p.kept_steps, packed.Packed)
                   for p in analyze_frame(f, OPTS).ranks)


def test_real_traces_of_other_tools_come_back_bit_for_bit(shared_data):
    """Kineto's two ranks and an Nsight Systems export: jittered nanoseconds, NaN bytes."""
    paths = [shared_data / "kineto" / "two_rank",
             *sorted((shared_data / "nsys").glob("*.sqlite"))[:1]]
    assert len(paths) == 2
    for path in paths:
        for steps in _steps(path):
            _same(steps, packed.pack(steps).unpack())


def test_unpacking_reads_one_value_at_a_time():
    made = []
    m = packed.Unpacking({1: packed.pack(np.arange(5.0)), 2: packed.pack(np.arange(3))},
                         lambda p: made.append(1) or p.unpack())
    assert len(m) == 2 and list(m) == [1, 2] and not made
    assert m[2].tolist() == [0, 1, 2] and len(made) == 1
    with pytest.raises(KeyError):
        m[3]


def test_differenced_buffers_wrap_and_come_back_bit_for_bit():
    """Sorted timestamps are held as steps; values whose steps overflow (the extremes of
    int64, NaNs and infinities among floats, 4-byte elements) come back as they were."""
    rng = np.random.default_rng(7)
    ts = np.cumsum(rng.integers(1, 200, 20_000)) + 1_700_000_000_000_000_000
    big = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0] * 500, np.int64)
    floats = np.where(rng.random(4_000) < 0.1, np.nan, rng.standard_normal(4_000))
    floats[:3] = [np.inf, -np.inf, -0.0]
    obj = {"ts": ts, "big": big, "floats": floats,
           "i32": np.cumsum(rng.integers(0, 3, 10_000)).astype(np.int32)}
    held = packed.pack(obj)
    assert any(b[2] for b in held.buffers)          # some held as steps
    assert packed.pack(ts).nbytes < ts.nbytes / 7    # sorted ns: about a byte a step
    back = held.unpack()
    for k, v in obj.items():
        assert back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes(), k
