# Loaded by every Python process that `gputrace record` starts (it is first on PYTHONPATH).
# It starts gputrace's in-process recorder, then runs the sitecustomize it hides, if any.
# It never imports torch or anything heavy; instrumentation waits for the job's own imports.
import os
import sys


def _gputrace_boot() -> None:
    shard_dir = os.environ.get("GPUTRACE_SHARD_DIR")
    if not shard_dir or os.environ.get("GPUTRACE_DISABLE") == "1":
        return
    try:
        from gputrace.record import inprocess
    except Exception as e:  # another Python without gputrace installed
        sys.stderr.write(f"gputrace: {sys.executable} cannot import gputrace ({e}); "
                         "this process is sampled but records no spans\n")
        return
    try:
        inprocess.boot(shard_dir)
    except Exception as e:  # never break the job
        sys.stderr.write(f"gputrace: in-process recorder did not start: {e}\n")


def _gputrace_chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin is None:
        return
    if os.path.abspath(spec.origin) == os.path.abspath(__file__):
        return
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = mod
    spec.loader.exec_module(mod)


_gputrace_boot()
del _gputrace_boot
_gputrace_chain()
