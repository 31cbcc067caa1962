"""Sampler: achieved rate and CPU cost of `gputrace record`'s sampler at 100 Hz and 1 kHz
while a busy training process (the CNN sample, all cores) runs.

    python bench/sampler.py [--iterations 40] [--tiny]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import PY, machine, run, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    rates = (100, 1000)
    if a.tiny:   # one rate: each runs the same code
        a.iterations, rates = 5, (1000,)
    rows = []
    sys_path = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        for hz in rates:
            out = Path(tmp) / f"s{hz}.arrow"
            run([PY, "-m", "gputrace", "record", "--hz", str(hz), "-o", str(out), "--", PY,
                 "samples/train_cnn.py", "--preset", "case1", "--iterations",
                 str(a.iterations)])
            _, q = run([PY, "-c", f"import sys; sys.path.insert(0, {sys_path!r}); "
                        "import gputrace, json; "
                        f"print(json.dumps(gputrace.load({str(out)!r}).metadata['sampler']))"])
            import json

            s = json.loads(q.stdout)
            rows.append([f"{hz} Hz", f"{s['achieved_hz']:.0f} Hz", f"{s['ticks']}",
                         f"{s['cpu_s']:.2f} s", f"{s['wall_s']:.1f} s",
                         f"{100 * s['cpu_s'] / s['wall_s']:.1f}% of one core"])
    print(table("Sampler of gputrace record beside a busy training job (host collectors)",
                ["asked", "achieved", "ticks", "CPU", "wall", "cost"], rows))
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
