"""The GPU check's offline install: gputrace and what this Python lacks of its dependencies,
and cupti-python with its own, from a folder of wheels (`make gpu-wheels`), into a fresh
target, never touching the packages already installed (the machine's torch).

A requirement this Python already satisfies is left to it (`present`); one it does not is
installed from the best wheel of WHEELS that this Python can use (`installed`); one with no
such wheel is `missing`, with the reason. Two targets: TARGET/base (gputrace and its
dependencies) and TARGET/cupti (cupti-python and its own), so that the same tests run with
and without cupti-python (PYTHONPATH with or without TARGET/cupti). pip installs the chosen
wheels (`pip install --no-index --no-deps --target`), or, without pip, they are unpacked.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

try:   # pip's own copy where there is no packaging
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pragma: no cover - depends on the machine
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.tags import sys_tags  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import parse_wheel_filename  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def index(wheels: Path) -> tuple[dict[str, list[tuple[Any, Path]]], list[str]]:
    """The wheels this Python can install, by project; and those it cannot, by file name."""
    ours = set(sys_tags())
    usable: dict[str, list[tuple[Any, Path]]] = {}
    other = []
    for w in sorted(wheels.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(w.name)
        if tags & ours:
            usable.setdefault(norm(name), []).append((version, w))
        else:
            other.append(w.name)
    return usable, other


def requires(wheel: Path) -> list[Requirement]:
    """A wheel's run-time requirements (no extras), whose markers hold on this Python."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(z.read(meta).decode())
    out = []
    for line in headers.get_all("Requires-Dist") or []:
        r = Requirement(line)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            out.append(r)
    return out


def plan(wheels: Path, roots: list[str], taken: set[str]) -> dict[str, Any]:
    """What to install for `roots` (always from WHEELS) and their dependencies (from WHEELS
    only where this Python lacks them or has a version they do not accept)."""
    usable, other = index(wheels)
    chosen: dict[str, Path] = {}
    present: dict[str, str] = {}
    missing: dict[str, str] = {}
    todo: list[tuple[Requirement, bool]] = [(Requirement(r), True) for r in roots]
    while todo:
        req, root = todo.pop(0)
        key = norm(req.name)
        if key in chosen or key in present or key in missing or key in taken:
            continue
        if not root:
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                have = None
            if have is not None and (not req.specifier or
                                     req.specifier.contains(have, prereleases=True)):
                present[key] = have
                continue
        fits = [(v, w) for v, w in usable.get(key, []) if req.specifier.contains(
            v, prereleases=True)]
        if not fits:
            also = [n for n in other if norm(parse_wheel_filename(n)[0]) == key]
            missing[key] = f"{req}: " + (
                f"no wheel for this Python ({', '.join(also)})" if also
                else f"not installed here and no wheel in {wheels}")
            continue
        version, wheel = max(fits, key=lambda t: Version(str(t[0])))
        chosen[key] = wheel
        todo += [(r, False) for r in requires(wheel)]
    return {"chosen": chosen, "present": present, "missing": missing}


def install(files: list[Path], target: Path) -> str:
    """Install wheel files into `target` without the network or their dependencies."""
    target.mkdir(parents=True, exist_ok=True)
    if not files:
        return "nothing to install"
    try:
        import pip  # noqa: F401
    except ImportError:
        for f in files:   # a wheel is a zip of what goes into site-packages
            with zipfile.ZipFile(f) as z:
                z.extractall(target)
        for data in target.glob("*.data"):
            for sub in ("purelib", "platlib"):
                for item in (data / sub).glob("*") if (data / sub).is_dir() else []:
                    item.rename(target / item.name)
        return "unpacked (no pip here)"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                        "--no-deps", "--no-compile", "--disable-pip-version-check", "--target", str(target),
                        *map(str, files)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"pip install failed: {p.stderr.strip().splitlines()[-1:]}")
    return "pip install --no-index --no-deps --target"


def run(wheels: Path, target: Path) -> dict[str, Any]:
    """Both targets; the figures for the summary (what was present, installed, missing)."""
    if not wheels.is_dir():
        raise FileNotFoundError(f"no wheel folder {wheels} (make gpu-wheels)")
    fig: dict[str, Any] = {"wheels": sorted(w.name for w in wheels.glob("*.whl")),
                           "wheels_bytes": sum(w.stat().st_size for w in wheels.glob("*.whl"))}
    base = plan(wheels, ["gputrace"], set())
    cupti = plan(wheels, ["cupti-python"], set(base["chosen"]))
    for part, got, where in (("base", base, target / "base"),
                             ("cupti", cupti, target / "cupti")):
        how = install(list(got["chosen"].values()), where)
        fig[part] = {"target": str(where), "how": how,
                     "installed": sorted(w.name for w in got["chosen"].values()),
                     "present": got["present"], "missing": got["missing"]}
    return fig
