"""FSDP2's settings as the job set them, read from its units' collectives (the collector
records each unit's `settings` in their args: collectors/torch/fsdp.py): prefetch, reshard
after forward and mixed precision per unit, and the run's prefetch depths they make."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gputrace.analyzers.parallel.sharded.shardinputs import Inputs

KEYS = ("reshard_after_forward", "forward_prefetch", "backward_prefetch", "param_dtype",
        "reduce_dtype")


@dataclass(frozen=True)
class Settings:
    """Per unit (in the order units first gathered) the settings its last collective in the
    analyzed iterations carried; the run's prefetch depths: forward, the most units one
    unit prefetches (`set_modules_to_forward_prefetch`, none: 0); backward, the most units
    one unit was given (`set_modules_to_backward_prefetch`), or 1, FSDP2's default
    (the previous unit), for a unit given none."""

    units: list[dict[str, Any]]
    prefetch_forward: int
    prefetch_backward: int
    changed: list[str] = field(default_factory=list)   # units whose settings changed

    @property
    def resharding(self) -> list[str]:
        return [u["unit"] for u in self.units if u.get("reshard_after_forward")]

    @property
    def keeping(self) -> list[str]:
        return [u["unit"] for u in self.units if not u.get("reshard_after_forward")]

    def one(self, key: str) -> Any:
        """The value every unit has for `key`, None when they differ."""
        vals = {repr(u.get(key)) for u in self.units}
        return self.units[0].get(key) if len(vals) == 1 and self.units else None

    def as_dict(self) -> dict[str, Any]:
        return {"source": "job", "prefetch_forward": self.prefetch_forward,
                "prefetch_backward": self.prefetch_backward,
                "units": [dict(u) for u in self.units], "changed": list(self.changed)}

    def text(self) -> str:
        """The settings as one line, each as it was read."""
        n = len(self.units)
        keep = self.keeping
        if not keep:
            rs = "reshard_after_forward on"
        elif len(keep) == n:
            rs = "reshard_after_forward off"
        else:
            rs = (f"reshard_after_forward on for {n - len(keep)} of {n} units (off: "
                  f"{', '.join(_name(k) for k in keep)})")
        fwd = (f"forward prefetch {self.prefetch_forward} "
               f"(set_modules_to_forward_prefetch)" if self.prefetch_forward else
               "forward prefetch 0")
        set_b = any(u.get("backward_prefetch") for u in self.units)
        bwd = (f"backward prefetch {self.prefetch_backward} "
               + ("(set_modules_to_backward_prefetch)" if set_b else "(FSDP2's default)"))
        mp = []
        for k in ("param_dtype", "reduce_dtype"):
            v = self.one(k)
            if v is not None or all(u.get(k) is None for u in self.units):
                mp.append(f"{k} {v or 'as the parameters'}")
            else:
                vals = sorted({str(u.get(k) or "none set") for u in self.units})
                mp.append(f"{k} per unit ({', '.join(vals)})")
        more = (f"; changed during the run: {', '.join(_name(c) for c in self.changed)} "
                "(the last shown)" if self.changed else "")
        return f"{rs}; {fwd}, {bwd}; {', '.join(mp)}{more}"


def _name(unit: str) -> str:
    return unit or "(root)"


def read(si: Inputs, sel: np.ndarray, order: list[str]) -> Settings | None:
    """The settings the analyzed iterations' collectives carried (None: none recorded, a
    recording made before they were, or FSDP1's); `order`: unit names, first gather first."""
    if not si.settings or not si.settings_of.size:
        return None
    m = np.flatnonzero((si.settings_of >= 0) & np.isin(si.it_of, sel))
    if not m.size:
        return None
    m = m[np.argsort(si.start[m], kind="stable")]
    last: dict[str, dict[str, Any]] = {}
    seen: dict[str, set[int]] = {}
    for j in m.tolist():
        s = si.settings[int(si.settings_of[j])]
        u = s["unit"]
        last[u] = s
        seen.setdefault(u, set()).add(int(si.settings_of[j]))
    rank = {u: i for i, u in enumerate(order)}
    units = [{"unit": u, **{k: last[u].get(k) for k in KEYS}}
             for u in sorted(last, key=lambda u: (rank.get(u, len(rank)), u))]
    fwd = max((len(u["forward_prefetch"] or []) for u in units), default=0)
    bwd = max((len(u["backward_prefetch"]) if u["backward_prefetch"] else 1 for u in units),
              default=1)
    return Settings(units, fwd, bwd, [u for u in seen if len(seen[u]) > 1])
