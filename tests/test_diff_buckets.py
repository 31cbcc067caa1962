"""`gputrace diff` of the sample CNN under 2-rank gloo DDP with two bucket sizes: the same
gradient bytes in fewer all-reduces, the comm units no longer matching. What it holds the
diff to is the runs' structure (their units, collectives and bytes), never a time: the two
runs need not see the same machine, so these tests run beside the others (not `serial`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gputrace  # noqa: E402
from tests.conftest import run_gputrace  # noqa: E402

SAMPLE = str(Path(__file__).resolve().parent.parent / "samples" / "train_cnn.py")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp_buckets(tmp_path_factory):
    """The sample CNN, 2-rank gloo DDP, with 1 MB buckets and with one bucket (100 MB)."""
    d = tmp_path_factory.mktemp("ddp")
    out = []
    for cap in ("1", "100"):
        trace = d / f"cap{cap}.arrow"
        p = run_gputrace("record", "-q", "-o", str(trace), "--", sys.executable, "-m",
                         "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         SAMPLE, "--preset", "case2", "--iterations", "10", "--samples", "256",
                         "--data", str(d / "data"), "--bucket-cap-mb", cap, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        out.append(trace)
    return out


def test_ddp_bucket_cap_change_is_seen_in_units_and_all_reduces(ddp_buckets):
    sys.path.insert(0, str(Path(SAMPLE).parent))
    from train_cnn import PRESETS, make_model

    cfg = PRESETS["case2"]
    grads = sum(p.numel() * p.element_size()
                for p in make_model(cfg["width"], cfg["fc_hidden"], cfg["fc_layers"]
                                    ).parameters())
    layers = 3 + cfg["fc_layers"] + 1
    d = gputrace.diff(*ddp_buckets, progress=False)
    # another bucketing: no comm unit matches, and the line says so
    assert not d["comparable"] and "comm units do not match" in d["not_comparable"]
    assert d["units"]["only_after"] == ["layers " + ",".join(map(str, range(1, layers + 1)))]
    assert len(d["units"]["only_before"]) > 1
    # the same gradients all-reduced, in fewer collectives
    ar = next(r for r in d["collectives"]["top"] if r["name"] == "all_reduce")
    assert ar["bytes_before"] == pytest.approx(grads, rel=0.01)
    assert ar["bytes_after"] == pytest.approx(grads, rel=0.01)
    assert ar["count_after"] == 1 < ar["count_before"]
    assert d["made"]["argv"][1][-1] == "100" and d["made"]["argv"][0][-1] == "1"
    assert sorted(d["ranks"]["top"][i]["name"] for i in range(2)) == ["0", "1"]
    # a run against itself: every bucket matched, no change, each interval holding 0
    same = gputrace.diff(ddp_buckets[0], ddp_buckets[0], progress=False)
    units = same["units"]
    assert units["matched"] == len(d["units"]["only_before"]) and units["top"]
    for r in units["top"]:
        assert r["change"] == 0 and r["low"] <= 0 <= r["high"] and not r["beyond_noise"]
