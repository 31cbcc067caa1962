"""The package's import rules, read from every module's own imports (ast, at any depth:
a function's local import counts too): the flow collectors -> trace -> analyzers -> report,
and the command line on top of it all.

- nothing below `gputrace/cli/` imports `gputrace.cli` (only `cli/` itself and
  `__main__`): the library raises its own errors, the command line turns them into exit
  codes;
- nothing under `gputrace/analyzers/` imports `gputrace.report` or `gputrace.cli`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "gputrace"


def imports_of(path: Path, here: str = "") -> set[str]:
    """The gputrace modules a file imports (absolute and relative), at any depth; `here`:
    its dotted name (default: from its place in the package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = here or ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:-node.level] if path.name != "__init__.py" else \
                    here.split(".")[:len(here.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in out if m == "gputrace" or m.startswith("gputrace.")}


def modules(under: str = "") -> list[Path]:
    return sorted((PKG / under).rglob("*.py"))


def reaches(mods: set[str], pkg: str) -> list[str]:
    return sorted(m for m in mods if m == pkg or m.startswith(pkg + "."))


@pytest.mark.parametrize("rule", ["cli", "analyzers"])
def test_imports_follow_the_flow(rule):
    broken = {}
    for p in modules():
        rel = p.relative_to(PKG).as_posix()
        if rule == "cli":
            if rel.startswith("cli/") or rel == "__main__.py":
                continue
            bad = reaches(imports_of(p), "gputrace.cli")
        else:
            if not rel.startswith("analyzers/"):
                continue
            bad = reaches(imports_of(p), "gputrace.report") + \
                reaches(imports_of(p), "gputrace.cli")
        if bad:
            broken[rel] = bad
    assert not broken, broken


def test_the_rules_see_a_local_import(tmp_path):
    """A function's own `from gputrace.cli import ...` (as ring.py had) is seen."""
    f = tmp_path / "ring.py"
    f.write_text("def f():\n    from gputrace.cli import CommandError\n"
                 "    from ..cli import parse_bytes\n")
    assert reaches(imports_of(f, "gputrace.analyzers.ring"), "gputrace.cli") == [
        "gputrace.cli", "gputrace.cli.CommandError", "gputrace.cli.parse_bytes"]
