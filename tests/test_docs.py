"""The manual says what the code does: every trace column the writer writes and every key
`analyze --json` produces is named in docs/format.md; every command's --help names its
page; the front page's links lead somewhere."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from gputrace.cli import MANUAL, main
from gputrace.trace import load
from gputrace.trace.schema import COLUMN_NAMES
from tests.conftest import run_gputrace
from tests.tracebuilder import Builder, ddp_iterations

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FORMAT = DOCS / "format.md"
JOB = ROOT / "tests" / "jobs" / "throughput_train.py"
CASE2_UNITS = [([4], 40, 62), ([3], 62, 72), ([2], 72, 84), ([1], 85, 92)]

# mappings whose keys are names from the run (a host, a collective kind, a parallelism):
# their children are documented as `*`
NAME_MAPS = {"hosts", "clock.hosts", "collectives.kinds", "collectives.kinds.*.parallelism",
             "checks.invariants", "withheld",
             "memory.ranks", "memory.phases", "memory.ranks.*.phases", "flops.ranks"}
# mappings of fixed names (the breakdown's terms): each child is documented by name, and
# what every child holds as `breakdown.*.mean`
TERM_MAPS = {"breakdown"}


def json_paths(doc: dict) -> set[str]:
    """Every key of an `analyze --json` document as the format page writes it: a dotted path,
    `[]` for a list's elements, `*` for a name; a rank's keys (`ranks.*`) as the top level's."""
    out: set[str] = set()

    def walk(value: object, prefix: str) -> None:
        if isinstance(value, list):
            for v in value:
                walk(v, prefix + "[]")
            return
        if not isinstance(value, dict):
            return
        for key, v in value.items():
            if prefix == "" and key == "ranks":
                out.add("ranks")
                out.add("ranks.*")
                for per_rank in v.values():
                    walk(per_rank, "")
                continue
            name = "*" if prefix in NAME_MAPS else key
            path = f"{prefix}.{name}" if prefix else name
            out.add(path)
            walk(v, f"{prefix}.*" if prefix in TERM_MAPS else path)

    walk(doc, "")
    return out


def documented(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


def column_rows(text: str) -> set[str]:
    """The columns the format page's table describes (rows `| `name` | type | ...`)."""
    return set(re.findall(r"^\| `([a-z_]+)` \| [a-z]", text, re.MULTILINE))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """`analyze --json` of two ranks of DDP with Case 2 (units, model, speedup, what-if)."""
    b = ddp_iterations(Builder(), CASE2_UNITS, n=8)
    ddp_iterations(b, CASE2_UNITS, n=8, rank=1, wait=3)
    path = b.write_by_rank(tmp_path_factory.mktemp("docs") / "two.arrow", world_size=2)
    return json.loads(run_gputrace("analyze", str(path), "--json", check=True).stdout)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, dict]:
    """A real recording of a token model's loop with a window (throughput, `window`, `run`),
    and its `analyze --json`."""
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("docs-rec")
    trace = d / "run.arrow"
    run_gputrace("record", "-o", str(trace), "--steps", "0:4", "--", sys.executable, str(JOB),
                 str(d / "truth"), "--tokens", "--iterations", "8", check=True)
    return trace, json.loads(run_gputrace("analyze", str(trace), "--json", check=True).stdout)


def test_every_json_key_is_on_the_format_page(built, recorded):
    keys = json_paths(built) | json_paths(recorded[1])
    # the documents hold what the page promises at least: a real run's throughput and window
    assert {"units[].ready_s", "what_if.scenarios[].t_iter", "collectives.kinds.*.count",
            "throughput.batch.shape", "window.steps", "run.phases_s.backward",
            "memory.ranks.*.phases.*.rss_peak_bytes", "memory.rss_peak_phase"} <= keys
    missing = sorted(keys - documented(FORMAT.read_text()))
    assert missing == [], f"analyze --json keys not in docs/format.md: {missing}"


def test_every_trace_column_is_on_the_format_page(recorded):
    written = set(load(recorded[0]).table.column_names)
    assert set(COLUMN_NAMES) <= written
    rows = column_rows(FORMAT.read_text())
    assert sorted(written - rows) == [], "trace columns not in docs/format.md's table"
    assert sorted(set(COLUMN_NAMES) - rows) == []


def test_the_key_check_sees_a_key_added_without_its_documentation(built):
    doc = dict(built, new_key=1, model=dict(built["model"], new_figure=0.5))
    missing = json_paths(doc) - documented(FORMAT.read_text())
    assert missing == {"new_key", "model.new_figure"}


@pytest.mark.parametrize("command", [None, *MANUAL])
def test_each_help_ends_with_its_page_of_the_manual(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"] if command else ["--help"])
    assert e.value.code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"manual: gputrace docs ([a-z-]+) \(docs/([a-z-]+\.md)\)?.*", last)
    assert m and m.group(2) == f"{m.group(1)}.md" and (DOCS / m.group(2)).is_file(), last
    nav = (ROOT / "mkdocs.yml").read_text()
    assert f": {m.group(2)}" in nav
    # and the command it names prints that page
    capsys.readouterr()
    assert main(["docs", m.group(1)]) == 0
    assert capsys.readouterr().out == (DOCS / m.group(2)).read_text()


def test_front_page_links_and_picture_exist():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    # the set-up commands come first (.ci/run runs `make test`)
    assert lines[3].startswith("make demo ") and lines[4].startswith("make test ")
    assert len(lines) <= 150
    links = re.findall(r"\]\(((?:docs/)?[A-Za-z.-]+\.(?:md|png)|LICENSE)(#[a-z0-9-]+)?\)", readme)
    assert ("docs/report.png", "") in links and ("docs/format.md", "") in links
    for target, anchor in links:
        assert (ROOT / target).is_file(), target
        if anchor:   # headings as MkDocs and code hosts make anchors of them
            heads = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(), re.MULTILINE)
            slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
                     for h in heads}
            assert anchor[1:] in slugs, (target, anchor)
    png = (DOCS / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
