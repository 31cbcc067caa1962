"""Progress bars: drawn on a terminal (a pseudo-terminal here) for analyze, report and import
of many ranks, and never in `--json` output, in a pipe or with GPUTRACE_PROGRESS=0."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.synth import write_arrow, write_kineto
from tests.conftest import GPUTRACE, run_gputrace

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RANKS = 48


def on_a_terminal(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run gputrace with stdout and stderr on a pseudo-terminal; what the terminal got."""
    master, slave = pty.openpty()
    p = subprocess.Popen([*GPUTRACE, *args], stdin=slave, stdout=slave, stderr=slave,
                         env={**os.environ, "TERM": "xterm", "COLUMNS": "100",
                              "GPUTRACE_PROGRESS_DELAY": "0", **(env or {})},
                         close_fds=True)
    os.close(slave)
    out = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:          # EIO: the terminal's other side closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return p.wait(timeout=300), out.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("progress") / "many.arrow"
    write_arrow(path, 80_000, ranks=RANKS)
    return path


def bar_shown(text: str, what: str, total: int) -> bool:
    """The bar's line for `what` went by with its count out of `total`."""
    plain = ANSI.sub("", text)
    return what in plain and f"/{total}" in plain


def test_analyze_of_many_ranks_shows_a_bar_on_a_terminal(many):
    code, text = on_a_terminal("analyze", str(many))
    assert code == 0, text[-2000:]
    assert bar_shown(text, "analyzing ranks", RANKS) and f"{RANKS}/{RANKS}" in ANSI.sub("", text)
    assert "\x1b[2K" in text                  # drawn and redrawn in place, then cleared
    assert "per iteration" in text             # the report follows it


def test_no_bar_in_json_output_in_a_pipe_or_when_turned_off(many):
    code, text = on_a_terminal("analyze", str(many), "--json")
    assert code == 0
    assert "analyzing ranks" not in text and "\x1b[" not in text
    assert json.loads(text.replace("\r\n", "\n"))["world_size"] == RANKS
    p = run_gputrace("analyze", str(many))           # stdout and stderr are pipes
    assert p.returncode == 0 and "analyzing ranks" not in p.stdout + p.stderr
    assert "\x1b[" not in p.stdout + p.stderr
    code, text = on_a_terminal("analyze", str(many), env={"GPUTRACE_PROGRESS": "0"})
    assert code == 0 and "analyzing ranks" not in text
    # work that ends before the delay (here: one far longer than the analysis) draws none
    code, text = on_a_terminal("analyze", str(many), env={"GPUTRACE_PROGRESS_DELAY": "600"})
    assert code == 0 and "analyzing ranks" not in text and "per iteration" in text


def test_analyze_with_jobs_and_report_show_their_bars(many, tmp_path):
    code, text = on_a_terminal("analyze", str(many), "--jobs", "2")
    assert code == 0, text[-2000:]
    assert bar_shown(text, "analyzing ranks", RANKS) and bar_shown(text, "replaying ranks", RANKS)
    pytest.importorskip("vl_convert")
    code, text = on_a_terminal("report", str(many), "-o", str(tmp_path / "r.html"))
    assert code == 0, text[-2000:]
    assert bar_shown(text, "analyzing ranks", RANKS) and "writing the report" in text


def test_import_shows_a_bar(tmp_path):
    src = tmp_path / "kineto"
    src.mkdir()
    write_kineto(src, 40_000, ranks=4)
    code, text = on_a_terminal("import", str(src), "-o", str(tmp_path / "i.arrow"))
    assert code == 0, text[-2000:]
    assert bar_shown(text, "importing Kineto files", 4)
    assert "converting" in ANSI.sub("", text)
    assert (tmp_path / "i.arrow").stat().st_size > 0


def test_record_merge_bar_only_on_a_terminal(tmp_path):
    job = tmp_path / "job_progress.py"
    job.write_text("import gputrace\n"
                   "for k in range(3):\n"
                   "    with gputrace.phase('forward'): pass\n"
                   "    gputrace.step()\n")
    code, text = on_a_terminal("record", "-f", "-o", str(tmp_path / "r.arrow"), "--",
                               sys.executable, str(job))
    assert code == 0, text[-2000:]
    assert "merging" in ANSI.sub("", text) and "shards into r.arrow" in ANSI.sub("", text)
    p = run_gputrace("record", "-f", "-o", str(tmp_path / "p.arrow"), "--", sys.executable,
                     str(job))
    assert p.returncode == 0 and "merging" not in p.stdout + p.stderr
