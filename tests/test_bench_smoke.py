"""Each benchmark runs once on a tiny size so it keeps working (figures are not checked:
benchmarks measure on quiet machines, see bench/README.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["analysis.py", "sampler.py", "overhead.py", "merge.py",
                                    "report.py", "whatif.py", "overhead_tf.py", "scale.py",
                                    "imports.py", "overhead_gpt.py", "whatif_pp.py",
                                    "whatif_ds.py", "whatif_ep.py", "whatif_pp_balance.py",
                                    "whatif_pp_inside.py", "whatif_ds_pipe.py"])
def test_benchmark_runs_tiny(script, tmp_path):
    if script == "overhead_tf.py" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not installed (make test installs it)")
    if script.startswith("whatif_ds") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (make test installs it)")
    args = [sys.executable, str(BENCH / script), "--tiny"]
    if script == "overhead.py":   # a smaller batch of smaller images: the same runs, cheaper;
        # "hooks only" is the gputrace mode's command with --collectors torch: not run here
        args += ["--ranks", "1", "--save", str(tmp_path / "runs.json"),
                 "--modes", "plain,gputrace,torch.profiler",
                 "--sample-args=--batch-size 8 --image-size 32"]
    if script == "overhead_gpt.py":   # runs side by side on one core (overhead.py: in turn)
        args += ["--ranks", "1", "--together"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=BENCH.parent)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "machine:" in p.stdout and "x" in p.stdout
    if script == "overhead.py":   # the kept runs give the same table again, with no new run
        again = subprocess.run([sys.executable, str(BENCH / script), "--tiny",
                                "--rounds", "0", *args[3:]],
                               capture_output=True, text=True, timeout=600, cwd=BENCH.parent)
        assert again.returncode == 0, again.stderr[-2000:]
        def runs(out: str) -> list[str]:   # the table of the runs (hookcost is timed anew)
            return [line for line in out.split("Cost accounting")[0].splitlines()
                    if line.startswith("1 process")]

        assert len(runs(p.stdout)) == 1 and runs(p.stdout) == runs(again.stdout)
        assert "Cost accounting" in again.stdout
    if script == "whatif.py":   # two runs, each predicting the other: an error reported
        # for each, but where a run's replay of itself missed it by over 5 % (a loaded
        # machine), its prediction is withheld ("-") and not counted
        withheld = [ln for ln in p.stdout.splitlines() if ln.rstrip().endswith(" -")]
        if len(withheld) < 2:
            assert f"bucket predictions: {2 - len(withheld)}," in p.stdout, p.stdout
            assert set(whatif_errors(p.stdout)) == {"bucket"}
        else:   # both withheld: no summary line of no predictions
            assert len(withheld) == 2 and not whatif_errors(p.stdout), p.stdout
    if script == "whatif_pp.py":   # 2 and 4 microbatches, each predicting the other
        assert "replayed with the target's own compute: 2 predictions" in p.stdout, p.stdout
        assert "fitted with a calibrating run: 2 predictions" in p.stdout, p.stdout
    if script == "whatif_pp_inside.py":   # 2 predicting 4 microbatches, probed and not
        assert "probed: 1 predictions" in p.stdout, p.stdout
        assert "proportional: 1 predictions" in p.stdout, p.stdout
    if script == "whatif_pp_balance.py":   # 5 + 1 blocks predicting 3 + 3, or saying why not
        assert "Layers balanced across stages" in p.stdout and " 5,1 " in p.stdout, p.stdout
    if script == "whatif_ds_pipe.py":   # 2 and 4 microbatches, each predicting the other
        assert "probed: 2 predictions" in p.stdout, p.stdout
    if script == "whatif_ds.py":   # one bucket and a quarter, each predicting the other
        import re

        counts = re.findall(r"^predictions (?:at one machine speed|the others): (\d+),",
                            p.stdout, re.M)
        assert sum(map(int, counts)) == 2, p.stdout


def whatif_errors(out: str) -> dict[str, float]:
    import re

    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r"(\w+) predictions: \d+, median \|error\| ([\d.]+)%", out)}
