from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GPUTRACE = [sys.executable, "-m", "gputrace"]


def run_gputrace(*args: str, cwd: str | os.PathLike[str] | None = None, timeout: float = 180,
                 env: dict[str, str] | None = None, check: bool = False
                 ) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess, as a user would."""
    p = subprocess.run([*GPUTRACE, *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"gputrace {' '.join(args)} -> {p.returncode}\n"
                             f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def job_file(path: Path) -> Path:
    """A path for a job script, refused if its name is a standard-library module's: the
    script's directory comes first on sys.path, and `copy.py` there breaks `import copy`
    in everything the job imports."""
    if path.stem in sys.stdlib_module_names:
        raise ValueError(f"{path.name} would shadow the standard library's {path.stem}")
    return path


def write_h2d_job(path: Path, mib: int) -> Path:
    """A CUDA job for the gpu-marked tests: pageable and pinned H2D copies of `mib` MiB in
    an `h2d` phase, then a kernel in a `forward` phase, five times."""
    job_file(path).write_text(
        "import torch, gputrace\n"
        f"x = torch.empty({mib} << 20, dtype=torch.uint8)\n"
        "xp = x.pin_memory()\n"
        "for k in range(5):\n"
        "    with gputrace.phase('h2d'):\n"
        "        a = x.to('cuda'); b = xp.to('cuda', non_blocking=True)\n"
        "        torch.cuda.synchronize()\n"
        "    with gputrace.phase('forward'):\n"
        "        (a.float() * 2).sum().item()\n")
    return path


@pytest.fixture(scope="session", autouse=True)
def probe_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Probe results go to a per-session directory, never the user's cache, so traces
    recorded by tests carry only the probes the tests make."""
    d = tmp_path_factory.mktemp("probe-cache")
    old = os.environ.get("GPUTRACE_CACHE_DIR")
    os.environ["GPUTRACE_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("GPUTRACE_CACHE_DIR", None)
    else:
        os.environ["GPUTRACE_CACHE_DIR"] = old


# Every analysis the suite makes, in this process and in every `gputrace` it starts, checks
# itself strictly: a broken consistency invariant (analyzers.findings.invariants) is an error, so a
# job shape that makes the analysis contradict itself fails the suite. Tests of the
# invariants themselves lift it for the commands they run.
os.environ["GPUTRACE_STRICT_CHECKS"] = "1"


@pytest.fixture
def shared_data() -> Path:
    d = SHARED / "data"
    if not d.is_dir():
        pytest.skip(f"{d} not present")
    return d


# The test files that take longest (seconds of their tests on 2 cores, `--durations=0`,
# 2026-11: 190 down to 55 s), longest first: `make test` hands whole files to its workers
# in collection order (`--no-loadscope-reorder`), so these start first and the last files
# handed out are short ones, rather than a 3-minute file starting as the others finish.
LONGEST_FIRST = ("test_bench_smoke", "test_whole_run", "test_trainers", "test_tensorflow",
                 "test_e2e_torch", "test_recompute", "test_docs_run", "test_hangs",
                 "test_torch_layers", "test_pipeline_schedules", "test_parallelism",
                 "test_window_samples", "test_window", "test_deepspeed", "test_interop",
                 "test_flops", "test_reliability", "test_collectives", "test_multinode",
                 "test_one_process", "test_scale_guard", "test_roles")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`make test`'s second part (`-m serial`) imports only the files that name the mark:
    collecting every file again cost 8-9 s of CPU (pytest rewrites each file's asserts anew
    where PYTHONDONTWRITEBYTECODE is set) for 22 tests in 6 files."""
    if (config.getoption("markexpr", "") == "serial" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        try:
            return None if "serial" in collection_path.read_text() else True
        except OSError:
            return None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: order.get(it.path.stem, len(order)))   # stable: else as found
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        has_gpu = True
    except OSError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU/driver on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
