"""The manual's and the README's command lines, run as a reader would type them: each in a
directory holding what the line names (`train.py`, a small real training script;
`trace.arrow`, `before.arrow` and `after.arrow`, its recordings under torchrun; the real
Kineto and Nsight Systems files of ../shared/data as `rank0.json.gz`, `report.sqlite` and
`kineto_dir/`), exit 0 with output. The lines that cannot run here say why (a running job
to capture, an elided command line)."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import SHARED, run_gputrace
from tests.test_docs_examples import EXAMPLES, ROOT

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

TRAIN = '''\
"""A small data-parallel training loop: runs under python (one process) or torchrun."""
import os

import torch
import torch.distributed as dist
from torch import nn

distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                      nn.Linear(128, 10))
if distributed:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(512, 64), torch.randint(0, 10, (512,)))
for x, y in torch.utils.data.DataLoader(data, batch_size=32):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
if distributed:
    dist.destroy_process_group()
'''

# lines that cannot run as shown, and where what they do is run instead
CANNOT = {
    "--repeat": "records its commands 3 times each (test_diff_runs.py records and diffs such "
                "runs)",
    "base-1.arrow": "reads the runs `record --repeat` makes (test_diff_runs.py)",
    "base-*.arrow": "reads the runs `record --repeat` makes (test_diff_runs.py)",
    "...": "an elided command line",
    "capture": "needs a job recording with --on-demand (test_capture.py)",
    "train_tp.py": "names the reader's script (the page's later block runs tests/jobs/tp_train.py)",
    "logdir/": "a profile TensorFlow wrote itself (test_tensorflow.py)",
    "--workers 2": "two TensorFlow workers (test_tensorflow.py records them)",
}


def _why_not(line: str) -> str | None:
    words = shlex.split(line)
    for key, why in CANNOT.items():
        if key in words or (" " in key and key in line) or (key == "..." and "..." in words):
            return why
    if "samples/train_tf.py" in line and importlib.util.find_spec("tensorflow") is None:
        return "tensorflow is not installed (make test installs it)"
    return None


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """What the lines name, made once: the recordings are real runs of train.py."""
    data = SHARED / "data"
    if not data.is_dir():
        pytest.skip(f"{data} not present")
    d = tmp_path_factory.mktemp("docs-run")
    (d / "train.py").write_text(TRAIN)
    p = run_gputrace("record", "-q", "-o", str(d / "trace.arrow"), "--", sys.executable,
                     "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     "train.py", cwd=d, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    # `diff` of the run and itself (an A/A pair); the README's `make demo` records such a run
    for name in ("before", "after", "demo"):
        shutil.copy(d / "trace.arrow", d / f"{name}.arrow")
    kineto = data / "kineto" / "two_rank"
    (d / "kineto_dir").mkdir()
    for r in (0, 1):
        src = kineto / f"sampled_rank-{r}.json.gz"
        (d / f"rank{r}.json.gz").symlink_to(src)
        (d / "kineto_dir" / src.name).symlink_to(src)
    (d / "report.sqlite").symlink_to(data / "nsys" / "mfu_2gpu_before.sqlite")
    return d


def _argv(line: str, cwd: Path) -> list[str]:
    """The line's words, `python` and `torchrun` as this interpreter's, the repository's
    paths (samples/, tests/jobs/) made absolute, /tmp/ names into the line's directory."""
    out = []
    for w in shlex.split(line)[1:]:
        if w == "python":
            w = sys.executable
        elif w == "torchrun":
            out += [sys.executable, "-m", "torch.distributed.run"]
            continue
        elif w.startswith(("samples/", "tests/")):
            w = str(ROOT / w)
        elif w.startswith("/tmp/"):
            w = str(cwd / w.removeprefix("/tmp/"))
        out.append(w)
    return out


def _output(line: str) -> str | None:
    words = shlex.split(line)
    return words[words.index("-o") + 1] if words[1] == "record" and "-o" in words else None


def _distinct() -> list[tuple[str, str]]:
    """Each command line once (the pages repeat the everyday ones), with its first place; a
    `record -o NAME` that a later line reads runs in that line's test, before it."""
    seen: dict[str, str] = {}
    for where, line in EXAMPLES:
        seen.setdefault(" ".join(shlex.split(line)), where)
    made = {_output(line): line for line in seen if _output(line)}
    read = {w for line in seen for w in shlex.split(line)[2:] if w in made
            and _output(line) != w}
    return [(where, line) for line, where in seen.items() if _output(line) not in read]


def _before(line: str) -> list[str]:
    """The record lines that make what `line` reads."""
    made = {_output(x): x for _, x in EXAMPLES if _output(x)}
    return [made[w] for w in shlex.split(line)[2:] if w in made and _output(line) != w]


DISTINCT = _distinct()


@pytest.mark.parametrize("where,line", DISTINCT, ids=[w for w, _ in DISTINCT])
def test_every_shown_command_runs(where, line, base, tmp_path):
    why = _why_not(line)
    if why:
        pytest.skip(f"{where}: {why}")
    argv = _argv(line, tmp_path)
    # the line's own directory: what it reads, and nothing a `record` would refuse to replace
    # (the traces copied: `recover` and `export` write beside theirs)
    for f in base.iterdir():
        if f.suffix == ".arrow":
            if not (argv[0] == "record" and f.name == "trace.arrow"):
                shutil.copy(f, tmp_path / f.name)
        else:
            (tmp_path / f.name).symlink_to(f)
    env = {**os.environ, "COLUMNS": "100"}
    for first in _before(line):
        p = run_gputrace(*_argv(first, tmp_path), cwd=tmp_path, env=env, timeout=300)
        assert p.returncode == 0, f"{where}: `{first}` -> {p.returncode}\n{p.stderr[-3000:]}"
    p = run_gputrace(*argv, cwd=tmp_path, env=env, timeout=300)
    if argv[0] == "recover":   # these recordings ended: its one line says so
        assert p.returncode == 2 and "nothing to recover" in p.stderr, (where, p.stderr)
        return
    ok = (0, 1) if "--fail-if-slower" in argv else (0,)   # 1: slower beyond the noise
    assert p.returncode in ok, f"{where}: `{line}` -> {p.returncode}\n{p.stderr[-3000:]}"
    assert p.stdout.strip() or any(f.is_file() and not f.is_symlink()
                                   for f in tmp_path.iterdir()), (where, p.stderr[-2000:])


def test_most_lines_run():
    """The skips stay the exception: most of the pages' lines run here."""
    runnable = [line for _, line in EXAMPLES if not _why_not(line)]
    assert len(runnable) >= 0.75 * len(EXAMPLES), (len(runnable), len(EXAMPLES))
