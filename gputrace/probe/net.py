"""InfiniBand ports and network interfaces: their nominal rates from sysfs.

Measuring a network link needs a transfer to another host, which one machine's probe cannot
start, so these figures are the rates the links negotiated, marked as such in `method`.
The record's infiniband collector measures the bytes actually moved during a run.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from gputrace.probe import unavailable

SYS = "/sys/class"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def ib_ports(root: str = SYS) -> list[dict[str, Any]]:
    ports = []
    for port_dir in sorted(glob.glob(os.path.join(root, "infiniband", "*", "ports", "*"))):
        device = port_dir.split(os.sep)[-3]
        rate = _read(os.path.join(port_dir, "rate")) or ""     # "200 Gb/sec (4X HDR)"
        state = _read(os.path.join(port_dir, "state")) or ""   # "4: ACTIVE"
        m = re.match(r"([0-9.]+)\s*Gb/sec", rate)
        ports.append({"device": device, "port": int(os.path.basename(port_dir)),
                      "rate": rate, "state": state.split(":")[-1].strip(),
                      "bytes_per_s": float(m.group(1)) * 1e9 / 8 if m else None})
    return ports


def nics(root: str = SYS) -> list[dict[str, Any]]:
    out = []
    for d in sorted(glob.glob(os.path.join(root, "net", "*"))):
        name = os.path.basename(d)
        if name == "lo" or not os.path.exists(os.path.join(d, "device")):
            continue  # loopback and virtual interfaces have no physical link
        speed = _read(os.path.join(d, "speed"))
        mbit = int(speed) if speed and speed.lstrip("-").isdigit() else -1
        out.append({"interface": name, "state": _read(os.path.join(d, "operstate")) or "",
                    "bytes_per_s": mbit * 1e6 / 8 if mbit > 0 else None})
    return out


def _nominal(items: list[dict[str, Any]], what: str, active: str, key: str
             ) -> dict[str, Any]:
    up = [x for x in items if x["state"].lower() == active and x["bytes_per_s"]]
    if not up:
        return unavailable(f"no {what} with a known rate is up" if items else f"no {what}")
    best = max(x["bytes_per_s"] for x in up)
    return {"status": "ok", "bytes_per_s": best, "min_bytes_per_s": best,
            "max_bytes_per_s": best, "repeats": 0, "bytes": 0,
            "method": f"nominal rate of the fastest active {what} from sysfs, not measured "
                      "(a transfer to another host is needed for that)", key: items}


def measure(root: str = SYS) -> dict[str, dict[str, Any]]:
    return {"ib": _nominal(ib_ports(root), "InfiniBand port", "active", "ports"),
            "nic": _nominal(nics(root), "network interface", "up", "interfaces")}
