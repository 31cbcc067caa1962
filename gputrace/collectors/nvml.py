"""NVML sampler (nvidia-ml-py, imported as `pynvml`): PCIe and NVLink traffic, utilization,
memory, clocks, power and temperature per GPU. Read-only: never changes a device setting.

Runs in the sampler process, never in the training process, and is initialized there (after
any fork). A metric a device does not support is skipped once, with its reason, and not
asked for again.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from gputrace.collectors import Unavailable
from gputrace.trace.writer import Row

_U32 = 1 << 32
_U64 = 1 << 64


def load_pynvml() -> ModuleType:
    try:
        import pynvml
    except ImportError:
        raise Unavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    return pynvml


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _Counter:
    """Extends a hardware counter across wraps (32- or 64-bit) into a monotone total."""

    __slots__ = ("last", "total")

    def __init__(self) -> None:
        self.last: int | None = None
        self.total = 0

    def update(self, raw: int) -> int:
        if self.last is None:
            self.total = raw
        elif raw >= self.last:
            self.total += raw - self.last
        else:  # wrapped: a counter below 2**32 wraps there, else at 2**64
            width = _U32 if self.last < _U32 else _U64
            self.total += raw + width - self.last
        self.last = raw
        return self.total


class NvmlCollector:
    name = "nvml"

    def __init__(self, host: str, nvml: ModuleType | None = None) -> None:
        self.nv = nv = nvml or load_pynvml()
        self.host = host
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            raise Unavailable(f"NVML cannot start: {e} (no NVIDIA driver or GPU here)") from None
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as e:
            nv.nvmlShutdown()
            raise Unavailable(f"NVML cannot count GPUs: {e}") from None
        if count == 0:
            nv.nvmlShutdown()
            raise Unavailable("NVML found no GPU")
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.skipped: dict[str, str] = {}   # "<device>.<metric>" -> reason
        self.counters: dict[tuple[int, str], _Counter] = {}
        self.nvlinks: list[list[int]] = [self._active_links(h) for h in self.handles]
        self.inventory = [self._describe(i, h) for i, h in enumerate(self.handles)]
        self.p2p = self._p2p_matrix()

    # -- inventory ---------------------------------------------------------------------------
    def _try(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nv.NVMLError:
            return None

    def _active_links(self, h: Any) -> list[int]:
        nv = self.nv
        links = []
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED:
                    links.append(link)
            except nv.NVMLError:
                break
        return links

    def _describe(self, i: int, h: Any) -> dict[str, Any]:
        nv = self.nv
        mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
        pci = self._try(nv.nvmlDeviceGetPciInfo, h)
        return {
            "index": i,
            "name": _text(self._try(nv.nvmlDeviceGetName, h) or "?"),
            "uuid": _text(self._try(nv.nvmlDeviceGetUUID, h) or "?"),
            "pci_bus_id": _text(pci.busId) if pci is not None else None,
            "pcie_gen": self._try(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            "pcie_width": self._try(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            "pcie_gen_max": self._try(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
            "pcie_width_max": self._try(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            "memory_bytes": int(mem.total) if mem is not None else None,
            "nvlinks": len(self.nvlinks[i]),
        }

    def _p2p_matrix(self) -> list[list[str]] | None:
        nv = self.nv
        fn = getattr(nv, "nvmlDeviceGetP2PStatus", None)
        if fn is None or len(self.handles) < 2:
            return None
        names = {getattr(nv, "NVML_P2P_STATUS_OK", 0): "ok"}
        index = getattr(nv, "NVML_P2P_CAPS_INDEX_READ", 0)
        if isinstance(index, tuple):  # nvidia-ml-py defines it as a 1-tuple
            index = index[0]
        out = []
        for a in self.handles:
            row = []
            for b in self.handles:
                if a is b:
                    row.append("self")
                    continue
                st = self._try(fn, a, b, index)
                row.append("?" if st is None else names.get(st, "no"))
            out.append(row)
        return out

    def settings(self) -> dict[str, Any]:
        return {"gpus": self.inventory, "p2p_read": self.p2p, "skipped": dict(self.skipped)}

    # -- sampling ----------------------------------------------------------------------------
    def _skip(self, dev: int, metric: str, e: Exception) -> None:
        self.skipped[f"{dev}.{metric}"] = str(e) or type(e).__name__

    def _on(self, dev: int, metric: str) -> bool:
        return f"{dev}.{metric}" not in self.skipped

    def _field_counters(self, dev: int, h: Any) -> tuple[list[tuple[str, float, int]], bool]:
        """PCIe byte counters and NVLink KiB counters from field values.
        Returns (name, bytes, timestamp_ns) triples and whether PCIe counters worked."""
        nv = self.nv
        out: list[tuple[str, float, int]] = []
        pcie_ok = False
        if self._on(dev, "pcie_counters"):
            try:
                vals = nv.nvmlDeviceGetFieldValues(
                    h, [nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES])
                for v, name in zip(vals, ("pcie.tx_bytes", "pcie.rx_bytes"), strict=True):
                    if v.nvmlReturn != nv.NVML_SUCCESS:
                        raise nv.NVMLError(v.nvmlReturn)
                    total = self.counters.setdefault((dev, name), _Counter()).update(
                        int(v.value.ullVal))
                    out.append((name, float(total), int(v.timestamp) * 1000))
                pcie_ok = True
            except nv.NVMLError as e:
                out = []
                self._skip(dev, "pcie_counters", e)
        links = self.nvlinks[dev]
        if links and self._on(dev, "nvlink"):
            try:
                ids = []
                for link in links:
                    ids.append((nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link))
                    ids.append((nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link))
                vals = nv.nvmlDeviceGetFieldValues(h, ids)
                tx = rx = 0
                ts = 0
                for k, v in enumerate(vals):
                    if v.nvmlReturn != nv.NVML_SUCCESS:
                        raise nv.NVMLError(v.nvmlReturn)
                    kib = self.counters.setdefault((dev, f"nvlink{k}"), _Counter()).update(
                        int(v.value.ullVal))
                    if k % 2 == 0:
                        tx += kib
                    else:
                        rx += kib
                    ts = max(ts, int(v.timestamp))
                out.append(("nvlink.tx_bytes", float(tx * 1024), ts * 1000))
                out.append(("nvlink.rx_bytes", float(rx * 1024), ts * 1000))
            except nv.NVMLError as e:
                self._skip(dev, "nvlink", e)
        return out, pcie_ok

    def sample(self, t_ns: int) -> list[Row]:
        nv = self.nv
        rows: list[Row] = []
        host = self.host

        def add(cat: str, name: str, value: float, unit: str, dev: int, t: int) -> None:
            rows.append(("sample", cat, name, t or t_ns, None, value, unit, host, -1, -1, -1,
                         dev, -1, -1, -1, None, None, None, None, None))

        for dev, h in enumerate(self.handles):
            counters, pcie_ok = self._field_counters(dev, h)
            for name, value, ts in counters:
                add(name.split(".")[0], name, value, "bytes", dev, ts)
            if not pcie_ok and self._on(dev, "pcie_throughput"):
                try:
                    tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
                    rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
                    add("pcie", "pcie.tx", tx * 1024.0, "bytes/s", dev, 0)
                    add("pcie", "pcie.rx", rx * 1024.0, "bytes/s", dev, 0)
                except nv.NVMLError as e:
                    self._skip(dev, "pcie_throughput", e)
            for metric, fn in self._simple:
                if not self._on(dev, metric):
                    continue
                try:
                    for name, value, unit in fn(self, h):
                        add("gpu", name, value, unit, dev, 0)
                except nv.NVMLError as e:
                    self._skip(dev, metric, e)
        return rows

    def _util(self, h: Any) -> list[tuple[str, float, str]]:
        u = self.nv.nvmlDeviceGetUtilizationRates(h)
        return [("gpu.util", float(u.gpu), "%"), ("gpu.mem_util", float(u.memory), "%")]

    def _mem(self, h: Any) -> list[tuple[str, float, str]]:
        return [("gpu.mem_used", float(self.nv.nvmlDeviceGetMemoryInfo(h).used), "bytes")]

    def _clock(self, h: Any) -> list[tuple[str, float, str]]:
        return [("gpu.sm_clock", float(self.nv.nvmlDeviceGetClockInfo(h, self.nv.NVML_CLOCK_SM)),
                 "MHz")]

    def _power(self, h: Any) -> list[tuple[str, float, str]]:
        return [("gpu.power", self.nv.nvmlDeviceGetPowerUsage(h) / 1000.0, "W")]

    def _temp(self, h: Any) -> list[tuple[str, float, str]]:
        t = self.nv.nvmlDeviceGetTemperature(h, self.nv.NVML_TEMPERATURE_GPU)
        return [("gpu.temp", float(t), "C")]

    _simple = (("util", _util), ("mem", _mem), ("clock", _clock), ("power", _power),
               ("temp", _temp))

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass
