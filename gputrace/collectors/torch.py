"""PyTorch auto-instrumentation."""

from __future__ import annotations

from typing import Any


def auto_instrument(rec: Any) -> str:
    return "unavailable: not implemented"
