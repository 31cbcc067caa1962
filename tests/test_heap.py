"""The analysis sets glibc's heap for its ranks (arrays up to 32 MiB from the heap, trimmed
only by gputrace: analyzers.run.reading) and hands it back after the last: a process that
calls gputrace.analyze (a notebook's) gets glibc's own mapping of large arrays again. (The
heap kept for the next rank, handed back before the ranks' parts are combined, is measured
by bench/scale.py: 1e7 events over 256 ranks, -j 1, 172 -> 147 MiB.)"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.synth import write_nodes

ROOT = Path(__file__).resolve().parents[1]

# mapped chunks (mallinfo2's hblks) while a 4 MiB array lives: glibc maps an allocation
# over its threshold (128 KiB by default) on its own, and serves one under it from the heap
PROBE = """
import ctypes, json, sys
import numpy as np
import gputrace
class M(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = M
def mapped_by(alloc):
    before = libc.mallinfo2().hblks
    kept = alloc()
    return libc.mallinfo2().hblks - before
out = {"before": mapped_by(lambda: np.ones(1 << 19))}
r = gputrace.analyze(sys.argv[1], jobs=1, progress=False)
out["ranks"] = len(r.analysis.ranks)
out["after"] = mapped_by(lambda: np.ones(1 << 19))
print(json.dumps(out))
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33 or later only")
def test_analysis_gives_the_heap_back_to_the_caller(tmp_path):
    write_nodes(tmp_path / "t", 200_000, 16)
    p = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "t" / "run.arrow")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["ranks"] == 16
    assert out["before"] == 1, out          # glibc's default: the 4 MiB array mapped
    assert out["after"] == 1, out           # and again after the analysis (not on the heap)
