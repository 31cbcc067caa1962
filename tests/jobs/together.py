"""A job of which several copies are started at once: each waits until `n` copies have
started (files in a directory), so their recordings run at the same moment, then runs four
iterations with a forward phase. Its rank comes from RANK, set by hand."""

import os
import sys
import time
from pathlib import Path

import gputrace

d, n = Path(sys.argv[1]), int(sys.argv[2])
d.mkdir(parents=True, exist_ok=True)
(d / f"{os.environ.get('RANK', '0')}.{os.getpid()}").touch()
t0 = time.time()
while len(list(d.iterdir())) < n and time.time() - t0 < 120:
    time.sleep(0.01)
for _ in gputrace.iterate(range(4)):
    with gputrace.phase("forward", layer=1):
        time.sleep(0.005)
    gputrace.step()
