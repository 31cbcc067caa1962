"""The package as users install it: `python -m build` makes a wheel and an sdist; the wheel,
installed with its `torch` extra into a fresh virtual environment that already has a torch,
keeps that torch, and its `gputrace` records and analyzes a job."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from gputrace import __version__

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# what a source distribution is made from (the build runs on a copy: nothing is written into
# the repository)
SOURCES = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md",
           "gputrace", "docs"]
JOB = ROOT / "tests" / "jobs" / "timed_loop.py"


def _env() -> dict[str, str]:
    """The environment of a user's shell: nothing pointing at this checkout's code."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSAFEPATH")}
    return env


def _run(*cmd: str | Path, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                       env=_env(), timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} -> {p.returncode}\n{p.stdout}\n"
                             f"{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("build.util", reason="python -m build needs the dev extra's `build`")
    d = tmp_path_factory.mktemp("package")
    src = d / "src"
    src.mkdir()
    for name in SOURCES:
        s = ROOT / name
        if s.is_dir():
            shutil.copytree(s, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(s, src / name)
    # the build backend from this environment (setuptools), as `pip wheel --no-build-isolation`
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", d / "dist", src, cwd=d)
    wheels = list((d / "dist").glob("gputrace-*.whl"))
    sdists = list((d / "dist").glob("gputrace-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list((d / "dist").iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "dir": d}


def test_wheel_and_sdist_hold_the_package_and_its_license(dist):
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = z.namelist()
        meta = z.read(f"gputrace-{__version__}.dist-info/METADATA").decode()
    assert "gputrace/py.typed" in names and "gputrace/record/bootstrap/sitecustomize.py" in names
    # the manual, every page of it, for `gputrace docs PAGE`
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(n.removeprefix("gputrace/manual/") for n in names
                  if n.startswith("gputrace/manual/")) == pages
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert "Requires-Dist: torch>=2.4; extra == \"torch\"" in requires
    # the front page's install line gives `report` too
    assert "Requires-Dist: vl-convert-python>=1.9; extra == \"torch\"" in requires
    # a framework is never pinned: an extra must not replace the one a user has
    frameworks = ("torch", "tensorflow", "keras", "lightning", "transformers", "accelerate")
    assert [r for r in requires if r.split()[1].startswith(frameworks) and "==" in r.split(";")[0]] == []
    with tarfile.open(dist["sdist"]) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"LICENSE", "README.md", "pyproject.toml", "gputrace/py.typed",
            "gputrace/record/bootstrap/sitecustomize.py", "docs/analysis.md"} <= members


@pytest.fixture(scope="module")
def venv(dist) -> dict[str, Path | str]:
    """A fresh virtual environment with this environment's packages visible to it (the
    core dependencies and a torch, so nothing is downloaded), but not its gputrace; the
    wheel installed there with `[torch]`, by pip, from no index."""
    try:
        torch = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch is not installed")
    d = dist["dir"]
    env = d / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", env, cwd=d)
    inner = Path(_run(env / "bin" / "python", "-c", "import sysconfig; "
                      "print(sysconfig.get_paths()['purelib'])", cwd=d).stdout.strip())
    # this environment's packages as a directory of links, less gputrace and its editable
    # install (a .pth line adds a directory to the path without running the .pth files in it)
    shared = d / "shared"
    shared.mkdir()
    for sp in dict.fromkeys(p for p in [*site.getsitepackages(), *sys.path]
                            if p.endswith("-packages") and os.path.isdir(p)):
        for entry in Path(sp).iterdir():
            if entry.name.lower().startswith(("gputrace", "__editable__", "_gputrace")) or \
                    entry.suffix == ".pth" or (shared / entry.name).exists():
                continue
            (shared / entry.name).symlink_to(entry)
    (inner / "shared.pth").write_text(f"{shared}\n")
    torch_dir = Path(torch.locate_file("torch"))
    before = _tree_stamp(torch_dir)
    wheel = f"{dist['wheel']}[torch]"
    p = _run(env / "bin" / "python", "-m", "pip", "install", "--no-index", wheel, cwd=d)
    return {"bin": env / "bin", "dir": d, "pip": p.stdout, "torch": torch.version,
            "torch_file": os.path.realpath(torch.locate_file("torch/__init__.py")),
            "torch_dir": torch_dir, "torch_stamp": before}


def _tree_stamp(d: Path) -> tuple[int, int]:
    """How many files a directory holds and their latest change (ns): a torch that pip
    replaced or touched shows in one or the other."""
    n, latest = 0, 0
    for root, _dirs, files in os.walk(d):
        for f in files:
            n += 1
            latest = max(latest, os.lstat(os.path.join(root, f)).st_mtime_ns)
    return n, latest


def test_installing_the_torch_extra_keeps_the_torch_there_is(venv):
    installed = [line for line in venv["pip"].splitlines() if line.startswith("Successfully")]
    assert installed == [f"Successfully installed gputrace-{__version__}"], venv["pip"]
    # the torch the environment's Python finds (read without importing it: seconds)
    p = _run(venv["bin"] / "python", "-c", "import os, importlib.metadata as m, gputrace; "
             "d = m.distribution('torch'); print(d.version); "
             "print(os.path.realpath(d.locate_file('torch/__init__.py'))); "
             "print(gputrace.__file__)", cwd=venv["dir"])
    version, torch_file, gputrace_file = p.stdout.split("\n")[:3]
    assert (version, torch_file) == (venv["torch"], venv["torch_file"])
    # the wheel's gputrace, not this checkout's
    assert gputrace_file.startswith(str(venv["bin"].parent)), gputrace_file
    assert _tree_stamp(venv["torch_dir"]) == venv["torch_stamp"]


def test_the_installed_command_records_and_analyzes(venv, tmp_path):
    gputrace = venv["bin"] / "gputrace"
    assert _run(gputrace, "--version", cwd=tmp_path).stdout.strip() == f"gputrace {__version__}"
    _run(gputrace, "record", "-o", "x.arrow", "--", venv["bin"] / "python", "-c", "pass",
         cwd=tmp_path)
    assert (tmp_path / "x.arrow").stat().st_size > 0
    info = _run(gputrace, "info", "x.arrow", cwd=tmp_path)
    assert "gputrace-trace v1" in info.stdout and "exit code: 0" in info.stdout
    # a job with no training loop: nothing to analyze, said in one line (exit 2)
    p = _run(gputrace, "analyze", "x.arrow", cwd=tmp_path, check=False)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == ("gputrace: error: x.arrow: the trace has no spans (no iterations or "
                        "phases) to analyze\n")


def test_the_front_pages_commands_run_from_the_install(venv, tmp_path):
    """record, analyze, report and diff, as the front page shows them, from the installed
    package alone (no checkout on the path); its manual from `gputrace docs`."""
    gputrace, py = venv["bin"] / "gputrace", venv["bin"] / "python"
    job = tmp_path / "timed_loop.py"
    shutil.copy2(JOB, job)
    for name in ("before", "after"):
        _run(gputrace, "record", "-o", f"{name}.arrow", "--", py, job, f"{name}.json",
             "--steps", "8", "--batch", "16", cwd=tmp_path)
    doc = json.loads(_run(gputrace, "analyze", "after.arrow", "--json", cwd=tmp_path).stdout)
    truth = json.loads((tmp_path / "after.json").read_text())
    # the iterations are the job's own optimizer steps
    assert doc["iterations"]["count"] == len(truth) == 8, doc["iterations"]
    out = _run(gputrace, "report", "after.arrow", "-o", "r.html", cwd=tmp_path).stdout
    assert out.startswith("report: r.html (") and (tmp_path / "r.html").stat().st_size > 100_000
    p = _run(gputrace, "diff", "before.arrow", "after.arrow", cwd=tmp_path)
    assert p.returncode == 0 and "t_iter" in p.stdout, p.stdout
    # the manual the help names is in the package
    last = _run(gputrace, "--help", cwd=tmp_path).stdout.strip().splitlines()[-1]
    assert last.startswith("manual: gputrace docs index "), last
    for page in ("index", "analysis"):
        shown = _run(gputrace, "docs", page, cwd=tmp_path).stdout
        assert shown == (ROOT / "docs" / f"{page}.md").read_text()
    listed = _run(gputrace, "docs", cwd=tmp_path).stdout
    assert "/gputrace/manual)" in listed.splitlines()[0], listed
