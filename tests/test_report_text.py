"""What a person reads: the report's width, the bandwidth line, the headline's C, counts,
`info` on an embedded session, --skip beyond the trace, export's default name."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import gputrace
from gputrace.fmt import count
from tests.conftest import GPUTRACE, run_gputrace
from tests.tracebuilder import Builder, ddp_iterations

CASE2_UNITS = [([4], 40, 62), ([3], 62, 72), ([2], 72, 84), ([1], 85, 92)]


def _case2(tmp_path, b=None):
    return ddp_iterations(b or Builder(), CASE2_UNITS).write(tmp_path / "run.arrow")


def test_a_report_written_to_a_file_is_not_wrapped(tmp_path):
    path = _case2(tmp_path)
    env = dict(os.environ, COLUMNS="60")       # no terminal: no width to wrap at
    out = tmp_path / "report.txt"
    with open(out, "w") as f:
        subprocess.run([*GPUTRACE, "analyze", str(path)], stdout=f, env=env, check=True,
                       timeout=60)
    lines = out.read_text().splitlines()
    assert lines[0].startswith("100.0 ms per iteration.") and lines[0].endswith("55%).")
    findings = lines[lines.index("Findings") + 1:]
    assert all(ln.startswith("  ") and ln.rstrip().endswith(".") for ln in findings), findings
    assert max(map(len, lines)) > 120


def test_on_a_terminal_the_report_wraps_at_its_width(tmp_path):
    path = _case2(tmp_path)
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 72, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["GPUTRACE_PROGRESS"] = "0"   # the bar is drawn and cleared apart (test_progress.py)
    p = subprocess.Popen([*GPUTRACE, "analyze", str(path)], stdout=child, stderr=child,
                         env=env)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:          # EIO: the other end closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert p.wait(timeout=60) == 0
    text = re.sub(r"\x1b\[[0-9;]*[a-zA-Z]", "", b"".join(chunks).decode())
    lines = text.replace("\r", "").splitlines()
    assert lines and max(map(len, lines)) <= 72, max(lines, key=len)
    assert sum(len(ln) > 60 for ln in lines) > 3       # it uses the width it has


def test_the_headline_says_what_c_is_in_the_tables_terms(tmp_path):
    p = run_gputrace("analyze", str(_case2(tmp_path)), check=True)
    head = p.stdout.splitlines()[0]
    # units 0 and 1 (layers 4 and 3) are the exposed ones in the unit table below
    assert "units 0-1 end after the next unit's gradients are ready" in head, head
    assert "C = 3: the lowest layer they hold, counting from 1 at the input" in head, head
    table = p.stdout[p.stdout.index("Gradient units"):].splitlines()[2:6]
    assert [r.split()[-1] for r in table] == ["no", "no", "yes", "last"]
    assert [r.split()[1] for r in table[:2]] == ["4", "3"]


def test_bandwidth_leaves_out_links_nothing_moved_over(tmp_path):
    b = Builder()
    for k in range(7):          # page-cache reads only: the disk counter stays still
        b.sample("proc.read_bytes", k * 100, 4096)
        b.sample("proc.read_chars", k * 100, k * 50e6)
    p = run_gputrace("analyze", str(_case2(tmp_path, b)), check=True)
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("Bandwidth:")]
    assert line.startswith("Bandwidth: page-cache reads (files already in memory) ") and \
        "disk" not in line, line
    b = Builder()
    for k in range(7):
        b.sample("proc.read_bytes", k * 100, 4096)
        b.sample("proc.read_chars", k * 100, 4096)
    p = run_gputrace("analyze", str(_case2(tmp_path, b)), check=True)
    assert "Bandwidth" not in p.stdout and "0.0 MB" not in p.stdout
    b = Builder()
    for k in range(7):          # a few KB from the page cache: a job reading its own files
        b.sample("proc.read_bytes", k * 100, 4096)
        b.sample("proc.read_chars", k * 100, 4096 + k * 5000)
    p = run_gputrace("analyze", str(_case2(tmp_path, b)), check=True)
    assert "Bandwidth" not in p.stdout and "0.0 MB" not in p.stdout, p.stdout


def test_skip_beyond_the_iterations_says_what_was_skipped(tmp_path):
    p = run_gputrace("analyze", "--skip", "100", str(_case2(tmp_path)), check=True)
    assert p.stderr.count("\n") == 1, p.stderr
    assert "--skip 100: rank 0 has 6 iterations; 5 skipped, the last 1 analyzed" in p.stderr
    assert "first 5 skipped as warm-up" in p.stdout
    p = run_gputrace("analyze", "--skip", "2", str(_case2(tmp_path)), check=True)
    assert p.stderr == ""
    p = run_gputrace("analyze", "--skip", "-1", str(_case2(tmp_path)))
    assert p.returncode == 2 and "--skip" in p.stderr


def test_info_on_an_embedded_session_says_so_instead_of_an_exit_code(tmp_path):
    out = tmp_path / "s.arrow"
    with gputrace.Session(str(out), sampler=False) as s:
        s.record_span("user", "x", 1, 2)
    p = run_gputrace("info", str(out), env=dict(os.environ, COLUMNS="200"), check=True)
    assert "embedded session (no exit code)" in p.stdout and "exit code: ?" not in p.stdout
    rec = tmp_path / "r.arrow"
    run_gputrace("record", "-q", "-o", str(rec), "--", sys.executable, "-c",
                 "raise SystemExit(3)")
    p = run_gputrace("info", str(rec), check=True)
    assert "exit code: 3" in p.stdout


def test_export_writes_the_default_name_its_help_gives(tmp_path):
    path = _case2(tmp_path)
    help_text = " ".join(run_gputrace("export", "--help", check=True).stdout.split())
    assert "run.arrow -> run.pftrace, run.trace.json" in help_text
    p = run_gputrace("export", "--format", "chrome", str(path), check=True)
    assert (tmp_path / "run.trace.json").exists()
    assert p.stdout.startswith(f"{tmp_path / 'run.trace.json'}: ")


def test_counts_read_as_english():
    assert [count(n, "row") for n in (0, 1, 2, 12345)] == ["0 rows", "1 row", "2 rows",
                                                           "12,345 rows"]
