"""InfiniBand port counters from sysfs (/sys/class/infiniband/<hca>/ports/<n>/counters)."""

from __future__ import annotations

import os
from typing import Any

from gputrace.collectors import Unavailable
from gputrace.trace.writer import Row

DEFAULT_ROOT = "/sys/class/infiniband"

# (sample name, unit, scale, candidate files: 64-bit extended counters first)
_COUNTERS = (
    ("xmit_bytes", "bytes", 4, ("counters_ext/port_xmit_data_64", "counters/port_xmit_data")),
    ("rcv_bytes", "bytes", 4, ("counters_ext/port_rcv_data_64", "counters/port_rcv_data")),
    ("xmit_packets", "packets", 1,
     ("counters_ext/port_xmit_packets_64", "counters/port_xmit_packets")),
    ("rcv_packets", "packets", 1,
     ("counters_ext/port_rcv_packets_64", "counters/port_rcv_packets")),
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class InfinibandCollector:
    """Port data counters count 4-byte words; they are scaled to bytes here."""

    name = "infiniband"

    def __init__(self, host: str, root: str | None = None) -> None:
        self.root = root or os.environ.get("GPUTRACE_IB_ROOT", DEFAULT_ROOT)
        self.host = host
        self.files: list[tuple[str, str, int, str]] = []  # (name, unit, scale, path)
        try:
            hcas = sorted(os.listdir(self.root))
        except OSError:
            raise Unavailable(f"no InfiniBand devices ({self.root} not present)") from None
        for hca in hcas:
            ports_dir = os.path.join(self.root, hca, "ports")
            try:
                ports = sorted(os.listdir(ports_dir), key=lambda p: (len(p), p))
            except OSError:
                continue
            for port in ports:
                base = os.path.join(ports_dir, port)
                for short, unit, scale, candidates in _COUNTERS:
                    for rel in candidates:
                        path = os.path.join(base, rel)
                        if _read_int(path) is not None:
                            self.files.append((f"ib.{hca}.{port}.{short}", unit, scale, path))
                            break
        if not self.files:
            raise Unavailable(f"no readable InfiniBand port counters under {self.root}")

    def settings(self) -> dict[str, Any]:
        return {"root": self.root, "counters": len(self.files)}

    def sample(self, t_ns: int) -> list[Row]:
        rows: list[Row] = []
        for name, unit, scale, path in self.files:
            v = _read_int(path)
            if v is None:
                continue
            rows.append(("sample", "ib", name, t_ns, None, float(v * scale), unit, self.host,
                         -1, -1, -1, -1, -1, -1, -1, None, None, None, None, None))
        return rows

    def close(self) -> None:
        pass
