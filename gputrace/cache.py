"""The per-user cache directory (`$GPUTRACE_CACHE_DIR`, else `$XDG_CACHE_HOME/gputrace` or
`~/.cache/gputrace`) and small JSON files kept in it: what is costly to compute again and
the same every time (this host's probe, Vega's bundled script, a pipeline schedule's order).
A file that cannot be read is a miss; one that cannot be written is left unwritten."""

from __future__ import annotations

import json
import os
from typing import Any


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("GPUTRACE_CACHE_DIR") or os.path.join(base, "gputrace")


def read_json(name: str) -> dict[str, Any]:
    """The JSON object kept as `name` in the cache, or {} (none, or unreadable)."""
    try:
        with open(os.path.join(cache_dir(), name), encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def write_json(name: str, d: dict[str, Any]) -> None:
    """Keep `d` as `name` in the cache, replaced whole (never half-written); nothing where
    the cache cannot be written."""
    path = os.path.join(cache_dir(), name)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(d, f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
