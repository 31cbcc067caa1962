"""Exit codes as the manual gives them (docs/analysis.md, docs/troubleshooting.md): 0 for
a command that did its work, 2 and one line for bad input (an empty file named as empty), 2
and the line to install it for a missing extra, the job's own code for `record`, 1 only for
`diff --fail-if-slower` and for a bug. Every command is here: a new one fails the first
test until it is added."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

from gputrace.cli import MANUAL, main
from tests.conftest import run_gputrace
from tests.test_docs import CASE2_UNITS
from tests.tracebuilder import Builder, ddp_iterations

# a bad input per command: (argv, a word the line must hold)
BAD = {
    "record": (["record", "-o", "{d}/good.arrow", "--", "true"], "exists"),
    "capture": (["capture", "999999999"], "no process"),
    "analyze": (["analyze", "{d}/nothing.arrow"], "no such file"),
    "diff": (["diff", "{d}/good.arrow", "{d}/nothing.arrow"], "no such file"),
    "info": (["info", "{d}/nothing.arrow"], "no such file"),
    "import": (["import", "{d}/nothing.json"], "no such file"),
    "export": (["export", "{d}/nothing.arrow"], "no such file"),
    "probe": (["probe", "--no-such-option"], "unrecognized"),
    "recover": (["recover", "{d}/nothing.arrow"], "no such file"),
    "report": (["report", "{d}/nothing.arrow"], "no such file"),
    "docs": (["docs", "no-such-page"], "no page"),
}
# the work each command does on good input, exit 0 (capture, probe and recover need a running
# job, minutes of measuring or a killed recording: tests/test_capture.py, test_probe.py and
# test_reliability.py hold them to exit 0)
GOOD = {
    "analyze": ["analyze", "{d}/good.arrow"],
    "diff": ["diff", "{d}/good.arrow", "{d}/good.arrow"],
    "info": ["info", "{d}/good.arrow"],
    "import": ["import", "{d}/kineto.json", "-o", "{d}/imported.arrow"],
    "export": ["export", "{d}/good.arrow", "--format", "chrome", "-o", "{d}/t.json"],
    "report": ["report", "{d}/good.arrow", "-o", "{d}/r.html"],
    "docs": ["docs", "analysis"],
}


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("codes")
    ddp_iterations(Builder(), CASE2_UNITS, n=8).write(root / "good.arrow", world_size=1)
    events = [{"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 0,
               "dur": 100, "pid": 1, "tid": 1}]
    (root / "kineto.json").write_text(json.dumps({"traceEvents": events}))
    (root / "t.xplane.pb").write_bytes(b"\x0a\x03not an xplane")   # read by its name
    return root


def _args(argv: list[str], d: Path) -> list[str]:
    return [a.format(d=d) for a in argv]


def test_every_command_is_held_to_its_codes():
    assert set(BAD) == set(MANUAL)


@pytest.mark.parametrize("command", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(command, d):
    argv, word = BAD[command]
    p = run_gputrace(*_args(argv, d))
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("gputrace: error: "), p.stderr
    assert word in p.stderr


@pytest.mark.parametrize("command", sorted(GOOD))
def test_good_input_is_exit_0(command, d):
    p = run_gputrace(*_args(GOOD[command], d))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip(), "a command that worked says what it did"


def test_record_keeps_the_jobs_code_and_127_for_a_command_that_cannot_run(tmp_path):
    p = run_gputrace("record", "-o", "x.arrow", "--", sys.executable, "-c", "raise SystemExit(3)",
                     cwd=tmp_path)
    assert p.returncode == 3, p.stderr
    p = run_gputrace("record", "-o", "y.arrow", "--", str(tmp_path / "no-such-program"),
                     cwd=tmp_path)
    assert p.returncode == 127 and "cannot run" in p.stderr


# gzip's header holds the time it was made (mtime 0 here): test ids the same on every
# xdist worker, which collect them at different seconds
@pytest.mark.parametrize("name, content, said", [
    ("t.json", b"", "the file is empty (0 bytes)"),
    ("t.json", b'{"traceEvents": []}', "'traceEvents' is empty"),
    ("t.json.gz", gzip.compress(b'{"traceEvents": []}', mtime=0), "'traceEvents' is empty"),
    ("t.json", b"{}", "no 'traceEvents' in it"),
], ids=["0-bytes", "empty-traceEvents", "empty-traceEvents-gz", "no-traceEvents"])
@pytest.mark.parametrize("command", ["analyze", "info", "import", "export"])
def test_an_empty_input_says_empty(name, content, said, command, tmp_path, capsys):
    (tmp_path / name).write_bytes(content)
    assert main([command, str(tmp_path / name), *(["-o", str(tmp_path / "out")]
                                                 if command in ("import", "export") else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_an_empty_arrow_file_says_empty(tmp_path, capsys):
    path = str(tmp_path / "t.arrow")
    Path(path).write_bytes(b"")
    for argv in (["analyze", path], ["info", path], ["report", path, "-o", f"{path}.html"],
                 ["diff", path, path]):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err == f"gputrace: error: {path}: the file is empty (0 bytes)\n"


def _without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment where importing these modules fails as where they are not installed
    (a directory ahead on the path whose package of that name raises ImportError)."""
    shadow = tmp_path / "without"
    for m in modules:
        (shadow / m).mkdir(parents=True)
        (shadow / m / "__init__.py").write_text(f"raise ImportError({'No module named ' + m!r})\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), *sys.path]))


@pytest.mark.parametrize("argv, extra", [
    (["report", "{d}/good.arrow", "-o", "{out}/r.html"], "report"),
    (["analyze", "{d}/good.arrow", "--report", "{out}/r.html"], "report"),
    (["report", "--diff", "{d}/good.arrow", "{d}/good.arrow", "-o", "{out}/r.html"], "report"),
    (["export", "{d}/good.arrow", "--format", "perfetto", "-o", "{out}/t.pftrace"], "export"),
    (["analyze", "{d}/good.arrow", "--dask", "tcp://127.0.0.1:1"], "cluster"),
    (["analyze", "{d}/good.arrow", "--ray", "auto"], "ray"),
    (["import", "{d}/t.xplane.pb", "-o", "{out}/x.arrow"], "tf"),
])
def test_a_missing_extra_exits_2_with_the_line_to_install_it(argv, extra, d, tmp_path):
    env = _without(tmp_path, "vl_convert", "perfetto", "dask", "ray", "tensorflow")
    p = run_gputrace(*[a.format(d=d, out=tmp_path) for a in argv], env=env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and f"pip install 'gputrace[{extra}]'" in p.stderr, \
        p.stderr
    assert not [p for p in ("r.html", "t.pftrace", "x.arrow") if (tmp_path / p).exists()]
