"""ZeRO-3's fetch rule replayed on hand-made traces (analyzers.parallel.sharded.zero3_fetch): a root module
without parameters, then layers of one large parameter (gathered) and one small
(persistent), forward then backward, as DeepSpeed's coordinator sees a Sequential MLP. The
rule's outcome on a real engine (how many all-gathers a run at another setting makes) is
held in tests/test_deepspeed.py."""

from __future__ import annotations

import pytest

from gputrace.analyzers.parallel.sharded import zero3_fetch as zf

W = 1000          # a layer's weight: gathered
B = 10            # its bias: persistent


def trace(layers: int = 4, compute_s: float = 0.010, busy_s: float = 0.0,
          backward: bool = True) -> list[zf.Fetch]:
    mods = [()] + [((2 * i, W, False), (2 * i + 1, B, True)) for i in range(layers)]
    order = mods + (mods[::-1][:-1] if backward else [])
    return [zf.Fetch(p, busy_s, compute_s if p else 0.0) for p in order]


def gathers(calls):
    return [(sorted(g), sorted(p)) for g, p in calls if g or p]


def test_the_default_prefetches_every_layer_at_the_first_fetch():
    f = trace()
    calls = zf.plan(f, zf.Rule(50_000_000, 1_000_000_000, 1_000_000_000))
    assert gathers(calls) == [([], [0, 2, 4, 6])]
    assert zf.gathered(calls) == 1
    assert zf.elements(f) == 4 * W


def test_a_bucket_of_one_layer_prefetches_one_layer_ahead():
    calls = zf.plan(trace(), zf.Rule(W, 1_000_000_000, 1_000_000_000))
    # the root prefetches layer 0; each layer the next; the last none; the backward none
    assert gathers(calls) == [([], [0]), ([], [2]), ([], [4]), ([], [6])]


def test_no_prefetch_gathers_each_layer_when_it_runs():
    calls = zf.plan(trace(), zf.Rule(0, 1_000_000_000, 1_000_000_000))
    assert gathers(calls) == [([0], []), ([2], []), ([4], []), ([6], [])]


def test_max_live_parameters_stops_prefetching_once_reached():
    calls = zf.plan(trace(), zf.Rule(50_000_000, 2 * W, 1_000_000_000))
    # the root's budget is 2 layers; after them nothing is released (reused in backward)
    assert gathers(calls) == [([], [0, 2]), ([4], []), ([6], [])]


def test_parameters_reused_beyond_the_reuse_distance_are_released_and_gathered_again():
    kept = zf.plan(trace(), zf.Rule(0, 1_000_000_000, 1_000_000_000))
    freed = zf.plan(trace(), zf.Rule(0, 1_000_000_000, 0))
    assert zf.gathered(kept) == 4
    # the last layer runs its backward right after its forward: within any distance of 0
    # elements it is still released, so every layer is gathered again in the backward
    assert zf.gathered(freed) == 8
    assert gathers(freed)[4:] == [([6], []), ([4], []), ([2], []), ([0], [])]


def test_replay_hides_a_prefetch_under_the_compute_before_it():
    f = trace(backward=False)
    alpha, beta = 0.001, 1e-6    # a layer's gather: 1 ms + 2 ms (500 elements x 4 bytes)
    none = zf.replay(f, zf.plan(f, zf.Rule(0, 10**9, 10**9)), 4, 2, alpha, beta)
    ahead = zf.replay(f, zf.plan(f, zf.Rule(W, 10**9, 10**9)), 4, 2, alpha, beta)
    svc = alpha + beta * (W // 2) * 4
    assert none[1] == pytest.approx(4 * svc)            # each layer waits for its own
    assert ahead[1] == pytest.approx(svc)               # only the first layer waits
    assert none[0] - ahead[0] == pytest.approx(3 * svc)
    assert none[2] == pytest.approx(ahead[2]) == pytest.approx(4 * svc)


def test_replay_of_one_large_prefetch_waits_for_all_of_it():
    f = trace(backward=False)
    alpha, beta = 0.001, 1e-6
    one = zf.replay(f, zf.plan(f, zf.Rule(10**8, 10**9, 10**9)), 4, 2, alpha, beta)
    assert one[1] == pytest.approx(alpha + beta * 4 * (W // 2) * 4)


def test_parse_takes_fetch_args_and_refuses_others():
    assert zf.parse('{"forward":true,"params":[[0,1000,0],[1,10,1]]}') == (
        True, ((0, 1000, False), (1, 10, True)))
    assert zf.parse('{"kind":"all_gather"}') is None
    assert zf.parse(None) is None


def test_each_pass_of_gradient_accumulation_begins_with_nothing_gathered():
    """Two forward and backward passes in one iteration (gradient accumulation): DeepSpeed
    resets its queue after each, so the second forward prefetches as the first did."""
    one = trace()
    marked = [zf.Fetch(f.params, f.busy_s, f.after_s, i < 5) for i, f in enumerate(one)]
    rule = zf.Rule(W, 1_000_000_000, 0)    # a layer ahead, released when done
    calls = zf.plan(marked + marked, rule)
    assert zf.gathered(calls) == 2 * zf.gathered(zf.plan(marked, rule))
    assert gathers(calls[:len(marked)]) == gathers(calls[len(marked):])
