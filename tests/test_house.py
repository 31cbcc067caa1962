"""The package's import rules, read from every module's own imports (ast, at any depth:
a function's local import counts too): the flow collectors -> trace -> analyzers -> report,
and the command line on top of it all.

- nothing below `gputrace/cli/` imports `gputrace.cli` (only `cli/` itself and
  `__main__`): the library raises its own errors, the command line turns them into exit
  codes;
- nothing under `gputrace/analyzers/` imports `gputrace.report` or `gputrace.cli`;
- inside `analyzers/`, one analysis of a run (`run/`) and the comparison of runs
  (`compare/`) sit on top: no other room imports them;
- every `__init__.py` under `analyzers/` only hands names on (a docstring, imports,
  `__all__`);
- the two sides apart: the recorder's (`recorder/`, what runs in the job beside the
  collectors) imports nothing of the analysis (`analysis/`, `analyzers/`), the report or
  the command line; the analysis side (`analysis/`) nothing of the recorder's
  (`recorder/`, `collectors/`, `record/`), the report or the command line."""

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


TOP_ROOMS = ("gputrace.analyzers.run", "gputrace.analyzers.compare")
# a side -> what it never imports
SIDES = {"recorder/": ("gputrace.analysis", "gputrace.analyzers", "gputrace.report",
                       "gputrace.cli"),
         "analysis/": ("gputrace.recorder", "gputrace.collectors", "gputrace.record",
                       "gputrace.report", "gputrace.cli")}


@pytest.mark.parametrize("rule", ["cli", "analyzers", "rooms", *SIDES])
def test_imports_follow_the_flow(rule):
    broken = {}
    for p in modules():
        rel = p.relative_to(PKG).as_posix()
        if rule == "cli":
            if rel.startswith("cli/") or rel == "__main__.py":
                continue
            bad = reaches(imports_of(p), "gputrace.cli")
        elif rule == "analyzers":
            if not rel.startswith("analyzers/"):
                continue
            bad = reaches(imports_of(p), "gputrace.report") + \
                reaches(imports_of(p), "gputrace.cli")
        elif rule in SIDES:
            if not rel.startswith(rule):
                continue
            bad = [m for pkg in SIDES[rule] for m in reaches(imports_of(p), pkg)]
        else:
            if not rel.startswith("analyzers/") or rel == "analyzers/__init__.py" or \
                    rel.startswith(("analyzers/run/", "analyzers/compare/")):
                continue
            bad = [m for top in TOP_ROOMS for m in reaches(imports_of(p), top)]
        if bad:
            broken[rel] = bad
    assert not broken, broken


def test_analyzer_packages_only_hand_names_on():
    """An analyzers package's __init__ holds a docstring, imports and `__all__`, no work."""
    busy = {}
    for p in modules("analyzers"):
        if p.name != "__init__.py":
            continue
        for node in ast.parse(p.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue
            if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets
                                                 ] == ["__all__"]:
                continue
            busy.setdefault(p.relative_to(PKG).as_posix(), []).append(node.lineno)
    assert not busy, busy


def test_the_rules_see_a_local_import(tmp_path):
    """A function's own `from gputrace.cli import ...` (as ring.py had) is seen."""
    f = tmp_path / "ring.py"
    f.write_text("def f():\n    from gputrace.cli import CommandError\n"
                 "    from ..cli import parse_bytes\n")
    assert reaches(imports_of(f, "gputrace.analyzers.ring"), "gputrace.cli") == [
        "gputrace.cli", "gputrace.cli.CommandError", "gputrace.cli.parse_bytes"]


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a module counts as
    that module; a package's __init__ as the package)."""
    mods = {}
    for p in modules():
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    out: dict[str, set[str]] = {}
    for name, p in mods.items():
        got = set()
        for m in imports_of(p):
            while m and m not in mods:
                m = m.rpartition(".")[0]
            if m and m != name and not name.startswith(m + "."):
                got.add(m)
        out[name] = got
    return out


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles: the sets of two or more modules each of which reaches every other
    through the imports."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for n in graph.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        reach[start] = seen
    out = {frozenset({a} | {b for b in reach[a] if a in reach[b]}) for a in graph
           if a in reach[a]}
    return sorted(out, key=sorted)


# the circles left, each to be broken by moving the state both sides share into a module
# they both import (never by a local import); a new one, or one grown, fails
KNOWN: list[set[str]] = []    # the circles still there (none)


def test_no_new_import_circle():
    got = [sorted(m.removeprefix("gputrace.") for m in c) for c in circles(_graph())]
    known = [set(k) for k in KNOWN]
    new = [c for c in got if not any(set(c) <= k for k in known)]
    assert not new, new


def test_a_circle_is_seen(tmp_path):
    """Three modules importing one another in a ring (one by a function's local import)."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(g) == [frozenset({"a", "b", "c"})]
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from gputrace.report.charts import charts\n")
    assert "gputrace.report.charts" in imports_of(f, "gputrace.report.chart_kit")
