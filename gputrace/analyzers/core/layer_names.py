"""A layer as people name it: its module path (`ResNetish.layer3.short.0`, shortened where
long), which the FLOP count records for each layer it numbers, else its class (`Conv2d`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

KEEP = 3     # a path of more parts keeps its last three: the root's class says little


def short(path: str) -> str:
    """'Net.blocks.11.attn.qkv' -> '…11.attn.qkv'; 'Sequential.0' stays."""
    parts = path.split(".")
    return path if len(parts) <= KEEP + 1 else "…" + ".".join(parts[-KEEP:])


def label(layer: int, name: str, module: str | None = None) -> str:
    """'17 …layer3.short.0 (Conv2d)' with its path, '17 Conv2d' without one."""
    if not module or module == name:
        return f"{layer} {name}"
    return f"{layer} {short(module)} ({name})"


def modules_of(table: pa.Table, rank: int | None = None) -> dict[int, str]:
    """Each layer's module path from the FLOP count's rows (`flops`, args.layers[].module)
    of `rank` (or any where there is one); empty where nothing was counted."""
    if "cat" not in table.column_names or "args" not in table.column_names:
        return {}
    rows = table.filter(pc.equal(table["cat"].cast(pa.string()), "flops"))
    out: dict[int, str] = {}
    for r in rows.select(["rank", "args"]).to_pylist():
        if rank is not None and r["rank"] not in (rank, -1, None) and out:
            continue
        try:
            layers = json.loads(r["args"] or "{}").get("layers") or []
        except (ValueError, AttributeError):
            continue
        for ly in layers:
            if isinstance(ly, dict) and ly.get("module") and isinstance(ly.get("layer"), int):
                if rank is None or r["rank"] == rank or ly["layer"] not in out:
                    out[ly["layer"]] = str(ly["module"])
    return out


def named(ly: dict[str, Any]) -> str:
    """A FLOP table row's label (its `layer`, `name`, `module`)."""
    return label(int(ly["layer"]), str(ly["name"]), ly.get("module"))


def modules_of_spans(sp: Any) -> dict[int, str]:
    """modules_of for one rank's spans (analyzers.core.frame.Spans)."""
    idx = np.flatnonzero(sp.of("flops"))
    if not idx.size:
        return {}
    args = sp.args.take(pa.array(idx)).to_pylist()
    return modules_of(pa.table({"cat": ["flops"] * len(args), "rank": [sp.rank] * len(args),
                                "args": args}), sp.rank)
