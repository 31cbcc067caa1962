"""The command lines the manual and the README show are ones gputrace takes: every
`gputrace ...` line of their code blocks parses with the real command line's parser (a
renamed or removed option fails here), and the CPU-runnable ones run (test_docs.py, the
demo's capture)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gputrace.cli import CommandError, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# words the pages write for what the reader fills in
PLACEHOLDERS = {"PID": "4242", "N": "20"}


def examples() -> list[tuple[str, str]]:
    """(page:line, command line) of every gputrace command in a code block."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        fenced = False
        i = 0
        while i < len(lines):
            raw = lines[i]
            if raw.lstrip().startswith("```"):
                fenced = not fenced
            text = raw.strip().removeprefix("$ ")
            block = fenced or raw.startswith("    ")
            if block and text.startswith("gputrace "):
                where = f"{page.name}:{i + 1}"
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                text = re.sub(r"\s+#\s.*$", "", text)
                out.append((where, text))
            i += 1
    return out


EXAMPLES = examples()


def test_the_pages_show_commands():
    assert len(EXAMPLES) > 30
    assert {shlex.split(t)[1] for _, t in EXAMPLES} >= {
        "record", "analyze", "report", "diff", "capture", "import", "export", "probe",
        "recover", "info"}


@pytest.mark.parametrize("where,line", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_every_shown_command_line_parses(where, line):
    argv = [PLACEHOLDERS.get(w, w) for w in shlex.split(line)[1:]]
    try:
        build_parser().parse_args(argv)
    except CommandError as e:
        pytest.fail(f"{where}: `{line}` is not a command gputrace takes: {e}")
    except SystemExit as e:   # --help, --version
        assert e.code == 0, (where, line)
