"""A process of gputrace's own (the command's, its analysis workers') without pandas.

pyarrow imports pandas the first time it asks whether an object is a pandas one
(`pa.array`, `pa.scalar`, `fill_null`, `to_numpy`: every analysis): 0.3 s of CPU and ~40 MiB
of memory per process (369 modules) for nothing the analysis uses; where the import fails,
pyarrow goes on without it. `block` makes it fail. `find_spec("pandas")` still finds a spec
(torch._dynamo asks it as torch.distributed.pipelining is imported, and a finder that raised
there failed that import). Not for a process of someone else's (a notebook's, a training
job's)."""

from __future__ import annotations

import sys
from typing import Any


def block() -> None:
    """From now on `import pandas` fails in this process, unless it is imported already."""
    if "pandas" not in sys.modules and not any(isinstance(f, NoPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, NoPandas())


class NoPandas:
    """Finds pandas (a spec with no origin) and fails to load it: `import pandas` raises
    ModuleNotFoundError, as where pandas is not installed."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> Any:
        if name == "pandas" or name.startswith("pandas."):
            from importlib.machinery import ModuleSpec

            return ModuleSpec(name, self)
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise ModuleNotFoundError("gputrace's commands run without pandas",
                                  name=module.__name__)
