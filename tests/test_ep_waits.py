"""Expert parallelism's wait for the group's last rank and the balanced-routing replay, on a
hand-built 2-rank trace whose times give both by hand: per iteration a count exchange (8-9
ms), a dispatch (10-12 ms) that brings rank 0 1000 bytes and rank 1 3000, the experts'
compute (rank 0 4 ms, rank 1 12 ms) and the combine, which both leave at 26 ms."""

from __future__ import annotations

from pathlib import Path

import pytest

import gputrace
from tests.tracebuilder import Builder

GROUP = {"size": 2, "ranks": [0, 1], "name": "0"}


def _trace(path: Path, steps: bool = True, combine_at: dict[int, int] | None = None) -> Path:
    b = Builder()
    got = {0: 1000, 1: 3000}
    combine_at = combine_at or {0: 16, 1: 24}
    for rank in (0, 1):
        for k in range(8):
            t = k * 100
            step = k if steps else -1
            b.span("iteration", t, t + 100, step=step, rank=rank)
            b.span("forward", t + 5, t + 40, step=step, rank=rank)
            for s, e, nb, out, extra in (
                    (8, 9, 32, 32, {"integer": True}),
                    (10, 12, 2000, got[rank], {}),
                    (combine_at[rank], 26, got[rank], 2000, {})):
                b.span("comm", t + s, t + e, name="all_to_all", rank=rank, step=step,
                       nbytes=nb, args={"kind": "all_to_all", "phase": "forward",
                                        "async": False, "bytes_out": out, "group": GROUP,
                                        **extra})
            b.span("backward", t + 40, t + 80, step=step, rank=rank)
            b.span("update", t + 85, t + 95, step=step, rank=rank)
    return b.write_by_rank(str(path), world_size=2)


def _group(path: Path) -> dict:
    r = gputrace.analyze(path, progress=False)
    doc = r.to_dict()
    ep = doc["ranks"]["0"]["parallelism"]["expert_parallel"]
    assert ep["moe_layers"] == 1 and ep["roles"]["counts"]["count"] == 1
    g = ep["imbalance"]["groups"][0]
    table = {x["rank"]: x["wait_s"] for x in r.table("expert_parallel").records()}
    assert table == {int(k): v for k, v in g["wait_s"].items()}
    return g


def test_wait_for_the_last_rank_and_the_balanced_replay(tmp_path):
    """Rank 0 waits 8 ms in the combine for rank 1 (24 - 16), rank 1 nothing; at even
    loads each rank's experts take 8 ms (4 ms x 2000 / 1000, 12 ms x 2000 / 3000), so the
    section (8 to 26 ms) ends at 22 ms: 4 ms saved per iteration."""
    g = _group(_trace(tmp_path / "ep.arrow"))
    assert g["wait_s"]["0"] == pytest.approx(0.008, abs=1e-6)
    assert g["wait_s"]["1"] == pytest.approx(0.0, abs=1e-6)
    assert g["wait_by_layer"]["0"] == pytest.approx({"1": 0.008}, abs=1e-6)
    assert g["balanced_saves_s"] == pytest.approx(0.004, abs=1e-6)
    text = gputrace.analyze(tmp_path / "ep.arrow", progress=False)
    assert "the all-to-alls replayed give 4.0 ms less per iteration" in _shown(text)


def _shown(r: gputrace.Result) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r.show()
    return out.getvalue()


def test_a_balanced_replay_that_takes_longer_says_more(tmp_path):
    """The rank that receives fewer tokens computes longer (rank 0: 1000 bytes, 12 ms; rank
    1: 3000, 4 ms): scaled to the mean load its experts take 24 ms from 12, and the combine
    (2 ms after the last rank enters it) ends at 38 ms, not 26: balanced routing would
    cost 12 ms per iteration, said as more, never as a negative saving."""
    g = _group(_trace(tmp_path / "ep.arrow", combine_at={0: 24, 1: 16}))
    assert g["balanced_saves_s"] == pytest.approx(-0.012, abs=1e-6)
    text = _shown(gputrace.analyze(tmp_path / "ep.arrow", progress=False))
    assert "the all-to-alls replayed give 12.0 ms more per iteration" in text, text
    assert "-12.0 ms" not in text


def test_iterations_without_step_numbers(tmp_path):
    """Where the trace has no step numbers, the members' iterations match by their place
    among the analyzed ones: the same waits, not every iteration's all-to-alls in one."""
    g = _group(_trace(tmp_path / "ep.arrow", steps=False))
    assert g["wait_s"]["0"] == pytest.approx(0.008, abs=1e-6)
    assert g["balanced_saves_s"] == pytest.approx(0.004, abs=1e-6)
