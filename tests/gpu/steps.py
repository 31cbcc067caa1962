"""One step of the GPU check (tests/gpu/check.py runs each in its own time box):

    python tests/gpu/steps.py STEP CONTEXT.json RESULT.json

RESULT.json: {"status": "ran" | "failed", "reason": ..., "figures": {...}}. Every job runs
as a user runs it: `python -m gputrace record ... -- python JOB`, `analyze --json`, pytest
in a subprocess, with PYTHONPATH giving the working tree's gputrace first, then the
target the install step filled (TARGET/cupti for cupti-python, TARGET/base for the rest).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
GPU_TESTS = ["tests/test_collectors_gpu.py", "tests/test_kineto_fallback.py",
             "tests/test_probe.py", "tests/test_pp_probe.py"]
TRUTH = "tests/test_gpu_truth.py"
FIXTURES_MAX = 2 << 20


class Context:
    def __init__(self, path: Path) -> None:
        d = json.loads(path.read_text())
        self.out = Path(d["out"])
        self.wheels = Path(d["wheels"])
        self.target = Path(d["target"])
        self.logs = self.out / "logs"

    def env(self, cupti: bool = True, **extra: str) -> dict[str, str]:
        """The jobs' environment: the working tree's gputrace, then the target's packages
        (cupti-python only with `cupti`; without it, one the machine has is hidden)."""
        parts = [str(ROOT)]
        if cupti:
            parts.append(str(self.target / "cupti"))
        elif _machine_has_cupti():
            parts.insert(0, str(_hide_cupti(self.target)))
        parts.append(str(self.target / "base"))
        old = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(parts + ([old] if old else [])))
        env.update(extra)
        return env


def _machine_has_cupti() -> bool:
    import importlib.util
    return importlib.util.find_spec("cupti") is not None


def _hide_cupti(target: Path) -> Path:
    d = target / "no-cupti"
    (d / "cupti").mkdir(parents=True, exist_ok=True)
    (d / "cupti" / "__init__.py").write_text(
        "raise ImportError('cupti-python hidden by the GPU check (the Kineto fallback run)')\n")
    return d


def sh(cmd: list[str], env: dict[str, str], log: Path, timeout: float | None = None,
       cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run a command (from the repository root); its output into `log` too."""
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}[exit {p.returncode}]\n")
    return p


def pyjson(code: str, env: dict[str, str], log: Path, cwd: Path = ROOT) -> Any:
    """Run Python code that prints one JSON document as its last line."""
    p = sh([PY, "-c", code], env, log, cwd=cwd)
    if p.returncode != 0:
        raise RuntimeError(f"{p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def pytest(ctx: Context, name: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """pytest in a subprocess; its outcomes from the JUnit XML, its printed JSON lines."""
    xml = ctx.logs / f"{name}.junit.xml"
    log = ctx.logs / f"{name}.pytest.log"
    cmd = [PY, "-m", "pytest", "-q", "-s", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *args]
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
                            ).returncode
    fig: dict[str, Any] = {"exit_code": rc, "log": str(log.relative_to(ctx.out)),
                           "passed": [], "failed": {}, "skipped": {}}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None \
                else case.find("error")
            skip = case.find("skipped")
            if bad is not None:
                fig["failed"][test] = (bad.get("message") or "")[:500]
            elif skip is not None:
                fig["skipped"][test] = (skip.get("message") or "")[:300]
            else:
                fig["passed"].append(test)
    printed = []
    for line in log.read_text(errors="replace").splitlines():
        i, j = line.find("{"), line.rfind("}")   # after pytest's progress, if any
        if 0 <= i < j:
            try:
                printed.append(json.loads(line[i:j + 1]))
            except ValueError:
                pass
    fig["printed"] = printed
    return fig


def pytest_result(fig: dict[str, Any]) -> dict[str, Any]:
    # 5: no test collected (all deselected)
    ok = fig["exit_code"] == 0 and not fig["failed"] and fig["passed"]
    out: dict[str, Any] = {"status": "ran" if ok else "failed", "figures": fig}
    if not ok:   # on a GPU every chosen test should pass: a skip says something is missing
        why = next(iter(fig["skipped"].values()), "") if not fig["passed"] else ""
        out["reason"] = (f"pytest exit code {fig['exit_code']}, {len(fig['failed'])} failed, "
                         f"{len(fig['passed'])} passed" + (f" (skipped: {why})" if why else ""))
    return out


# -- the steps ------------------------------------------------------------------------------
def step_install(ctx: Context) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import install

    shutil.rmtree(ctx.target, ignore_errors=True)
    fig = install.run(ctx.wheels, ctx.target)
    log = ctx.logs / "install.log"
    # the installed gputrace, alone on the path (not the working tree): it imports
    fig["imports"] = pyjson(
        "import json, importlib\nout = {}\n"
        "for m in ('gputrace', 'gputrace.cli', 'pyarrow', 'numpy', 'psutil', 'rich', 'nvtx', "
        "'pynvml', 'msgspec'):\n"
        "    try:\n        mod = importlib.import_module(m)\n"
        "        out[m] = getattr(mod, '__file__', '') or 'ok'\n"
        "    except Exception as e:\n        out[m] = f'error: {type(e).__name__}: {e}'\n"
        "print(json.dumps(out))", dict(os.environ, PYTHONPATH=str(ctx.target / "base")),
        log, cwd=ctx.target)
    gt = fig["imports"].get("gputrace", "")
    fig["gputrace_from_target"] = gt.startswith(str(ctx.target))
    fig["wheel_matches_tree"] = _wheel_matches_tree(ctx.target / "base")
    fig["cupti_import"] = pyjson(
        "import json\ntry:\n    import cupti.cupti as c\n    print(json.dumps('ok'))\n"
        "except Exception as e:\n    print(json.dumps(f'{type(e).__name__}: {e}'[:300]))",
        ctx.env(cupti=True), log)
    errors = [m for m, v in fig["imports"].items() if v.startswith("error")]
    if fig["base"]["missing"] or errors or not fig["gputrace_from_target"]:
        return {"status": "failed", "figures": fig,
                "reason": f"gputrace's dependencies: missing {sorted(fig['base']['missing'])}"
                          f", not importable {errors}"}
    return {"status": "ran", "figures": fig}


def _wheel_matches_tree(base: Path) -> dict[str, Any]:
    """Whether the installed gputrace is the working tree's (the jobs run the tree's)."""
    inst = {p.relative_to(base).as_posix(): p.read_bytes()
            for p in (base / "gputrace").rglob("*.py")}
    tree = {p.relative_to(ROOT).as_posix(): p.read_bytes()
            for p in (ROOT / "gputrace").rglob("*.py")}
    differ = sorted(k for k in set(inst) | set(tree) if inst.get(k) != tree.get(k))
    return {"same": not differ, "differ": differ[:20]}


ENV_CODE = r"""
import json, importlib.metadata as md
out = {}
def ver(d):
    try:
        return md.version(d)
    except md.PackageNotFoundError:
        return None
for d in ("torch", "cupti-python", "nvidia-cuda-cupti", "cuda-bindings", "cupy-cuda13x",
          "nvidia-ml-py", "nvtx", "pyarrow", "numpy", "gputrace"):
    out[d] = ver(d)
import torch
out["torch.version.cuda"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
if out["cuda_available"]:
    out["device"] = torch.cuda.get_device_name(0)
    out["capability"] = list(torch.cuda.get_device_capability(0))
    out["device_count"] = torch.cuda.device_count()
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:
        out["nccl"] = f"{type(e).__name__}: {e}"
from gputrace.collectors.cupti import availability
out["cupti_availability"] = availability()
print(json.dumps(out))
"""

CUPTI_PROBE = ("import torch\nx = torch.ones(1 << 20, device='cuda')\n"
               "for _ in range(3):\n    (x * 2).sum().item()\n")


def step_environment(ctx: Context) -> dict[str, Any]:
    log = ctx.logs / "environment.log"
    fig: dict[str, Any] = {}
    smi = shutil.which("nvidia-smi")
    if smi:
        p = sh([smi, "--query-gpu=name,driver_version,memory.total,pci.bus_id",
                "--format=csv,noheader"], dict(os.environ), log, timeout=30)
        fig["nvidia_smi"] = p.stdout.strip().splitlines() if p.returncode == 0 \
            else f"exit {p.returncode}: {p.stderr.strip()[:200]}"
        sh([smi], dict(os.environ), log, timeout=30)
    else:
        fig["nvidia_smi"] = None
    try:
        fig["python"] = pyjson(ENV_CODE, ctx.env(cupti=True), log)
    except RuntimeError as e:
        fig["python"] = {"error": str(e)}
    cuda = bool(fig["python"].get("cuda_available"))
    if not smi:
        fig["gpu"], fig["no_gpu_reason"] = False, "no nvidia-smi on this machine"
    elif "error" in fig["python"]:
        fig["gpu"], fig["no_gpu_reason"] = False, f"torch: {fig['python']['error']}"[:300]
    elif not cuda:
        fig["gpu"], fig["no_gpu_reason"] = False, "torch.cuda.is_available() is false"
    else:
        fig["gpu"] = isinstance(fig["nvidia_smi"], list)
        if not fig["gpu"]:
            fig["no_gpu_reason"] = f"nvidia-smi failed: {fig['nvidia_smi']}"
    if fig["gpu"]:   # whether gputrace can enable CUPTI: a short job recorded with it
        with tempfile.TemporaryDirectory() as tmp:
            job, trace = Path(tmp) / "probe_job.py", Path(tmp) / "p.arrow"
            job.write_text(CUPTI_PROBE)
            env = ctx.env(cupti=True)
            p = sh([PY, "-m", "gputrace", "record", "-q", "--gpu-timeline", "cupti", "-o",
                    str(trace), "--", PY, str(job)], env, log, timeout=60)
            try:
                fig["cupti_record"] = pyjson(
                    "import json\nfrom gputrace import load\ntr = load(TRACE)\n"
                    "rows = tr.table.to_pylist()\n"
                    "print(json.dumps({'collector': tr.metadata['collectors'].get('cupti'), "
                    "'kernels': sum(r['cat'] == 'kernel' for r in rows)}))".replace(
                        "TRACE", repr(str(trace))), env, log) if p.returncode == 0 \
                    else f"record exit {p.returncode}"
            except (RuntimeError, ValueError) as e:
                fig["cupti_record"] = f"unreadable: {e}"[:300]
    return {"status": "ran", "figures": fig}


def step_gpu_tests_cupti(ctx: Context) -> dict[str, Any]:
    return pytest_result(pytest(ctx, "gpu_tests_cupti", ["-m", "gpu", *GPU_TESTS],
                                ctx.env(cupti=True)))


def step_gpu_tests_kineto(ctx: Context) -> dict[str, Any]:
    env = ctx.env(cupti=False)
    fig = pytest(ctx, "gpu_tests_kineto", ["-m", "gpu", *GPU_TESTS, TRUTH, "-k",
                                           "not capture and not test_cuda_loop_phases"], env)
    fig["cupti_importable"] = pyjson(
        "import json\ntry:\n    import cupti.cupti\n    print('true')\n"
        "except ImportError:\n    print('false')", env, ctx.logs / "gpu_tests_kineto.log")
    return pytest_result(fig)


def step_truth_loop(ctx: Context) -> dict[str, Any]:
    return pytest_result(pytest(ctx, "truth_loop", ["-m", "gpu", TRUTH, "-k",
                                                    "not capture and not cnn_sample"],
                                ctx.env(cupti=True)))


def step_cnn_cuda(ctx: Context) -> dict[str, Any]:
    log = ctx.logs / "cnn_cuda.log"
    env = ctx.env(cupti=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "cnn.arrow"
        p = sh([PY, "-m", "gputrace", "record", "-q", "-o", str(trace), "--", PY,
                "samples/train_cnn.py", "--device", "cuda", "--iterations", "40", "--data",
                str(Path(tmp) / "data")], env, log)
        if p.returncode != 0:
            return {"status": "failed", "reason": f"record exit {p.returncode}"}
        a = sh([PY, "-m", "gputrace", "analyze", str(trace), "--json"], env, log)
        if a.returncode != 0:
            return {"status": "failed", "reason": f"analyze exit {a.returncode}"}
        d = json.loads(a.stdout)
        source = pyjson(f"import json\nfrom gputrace import load\nprint(json.dumps(load("
                        f"{str(trace)!r}).metadata['collectors'].get('cupti')))", env, log)
    b = {k: v["mean"] for k, v in d["breakdown"].items() if isinstance(v, dict)
         and "mean" in v}
    share = b["t_other"] / b["t_iter"] if b.get("t_iter") else None
    fig = {"breakdown_ms": {k: round(v * 1e3, 3) for k, v in b.items()},
           "share_in_no_phase": None if share is None else round(share, 4),
           "goal_share_at_most": 0.05, "cupti": source}
    ok = share is not None and share <= 0.05
    return {"status": "ran" if ok else "failed", "figures": fig,
            **({} if ok else {"reason": f"share in no phase {share} above 5 %"})}


def step_capture(ctx: Context) -> dict[str, Any]:
    fig = pytest(ctx, "capture", ["-m", "gpu", TRUTH, "-k", "capture"],
                 ctx.env(cupti=True, GPUTRACE_CAPTURE_FIXTURES="1"))
    src, dst = ROOT / "tests" / "data" / "gpu", ctx.out / "fixtures"
    dst.mkdir(exist_ok=True)
    sizes = {}
    for f in sorted(src.glob("*")) if src.is_dir() else []:
        shutil.copy2(f, dst / f.name)
        sizes[f.name] = f.stat().st_size
    fig["fixtures"] = sizes
    fig["fixtures_bytes"] = sum(sizes.values())
    out = pytest_result(fig)
    if out["status"] == "ran" and not (0 < fig["fixtures_bytes"] <= FIXTURES_MAX):
        out.update(status="failed", reason=f"fixtures {fig['fixtures_bytes']} B (at most "
                                           f"{FIXTURES_MAX} B, more than none)")
    return out


def step_overhead(ctx: Context) -> dict[str, Any]:
    d = ctx.out / "overhead"
    d.mkdir(exist_ok=True)
    p = sh([PY, str(HERE / "overhead.py"), str(d)], ctx.env(cupti=True),
           ctx.logs / "overhead.log")
    res = d / "overhead.json"
    fig = json.loads(res.read_text()) if res.exists() else {}
    if p.returncode != 0:
        return {"status": "failed", "reason": f"overhead.py exit {p.returncode}",
                "figures": fig}
    return {"status": "ran", "figures": fig}


def step_nccl(ctx: Context) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from nccl_check import nccl

    return nccl(ctx, sh, pyjson, free_port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    name, ctx_path, result = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    ctx = Context(ctx_path)
    fn = globals().get(f"step_{name}")
    if fn is None:
        print(f"steps: no step {name!r}", file=sys.stderr)
        return 2
    try:
        out = fn(ctx)
    except Exception as e:  # the step's failure, in its result
        import traceback
        traceback.print_exc()
        out = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}
    result.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
