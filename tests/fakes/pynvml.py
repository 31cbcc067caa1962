"""A pynvml-shaped fake (constants, NVMLError, the device queries gputrace makes), for CPU
tests. Devices are configured per test; each call is counted so tests can check that an
unsupported metric is asked for once and then skipped."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_FEATURE_ENABLED = 1
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_P2P_CAPS_INDEX_READ = (0,)   # a 1-tuple in the real nvidia-ml-py as well
NVML_NVLINK_MAX_LINKS = 18
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 9: "Driver Not Loaded"}.get(self.value, f"error {self.value}")


class FakeNvml:
    """One fake NVML library. `devices` are dicts: name, pcie_counters (list of (tx, rx) raw
    readings, one per sample, may wrap), pcie_rate (KB/s), nvlink (list of per-sample
    [(tx_kib, rx_kib) per link]), unsupported (set of metric names), power_mw, ..."""

    NVMLError = NVMLError

    def __init__(self, devices: list[dict], init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        self.samples = [0] * len(devices)
        self.nvlink_reads = [0] * len(devices)
        for k, v in globals().items():
            if k.startswith("NVML_"):
                setattr(self, k, v)

    def _dev(self, h):
        return self.devices[h]

    def _check(self, h, metric: str) -> dict:
        self.calls[f"{h}.{metric}"] += 1
        d = self._dev(h)
        if metric in d.get("unsupported", ()):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return d

    def nvmlInit(self):
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls["shutdown"] += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self._dev(h).get("name", "Fake GPU").encode()

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-fake-{h}"

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{h + 1:02x}:00.0".encode())

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._dev(h).get("gen", 4)

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._dev(h).get("width", 16)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 * 2**30, used=self._check(h, "mem").get("mem_used", 2**30))

    def nvmlDeviceGetNvLinkState(self, h, link):
        n = len((self._dev(h).get("nvlink") or [[]])[0])
        if link >= NVML_NVLINK_MAX_LINKS:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return NVML_FEATURE_ENABLED if link < n else 0

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if not isinstance(index, int):
            raise TypeError("index must be an int, as the C function takes")
        return NVML_P2P_STATUS_OK if self._dev(a).get("p2p", True) else \
            NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetFieldValues(self, h, ids):
        d = self._dev(h)
        k = self.samples[h]
        out = []
        pcie = ids[0] in (NVML_FI_DEV_PCIE_COUNT_TX_BYTES,)
        self.calls[f"{h}.{'pcie_counters' if pcie else 'nvlink'}"] += 1
        if pcie:
            if "pcie_counters" in d.get("unsupported", ()):
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            seq = d["pcie_counters"]
            tx, rx = seq[min(k, len(seq) - 1)]
            self.samples[h] += 1
            vals = [tx, rx]
        else:
            seq = d["nvlink"]
            j = self.nvlink_reads[h]
            self.nvlink_reads[h] += 1
            links = seq[min(j, len(seq) - 1)]
            vals = [v for pair in links for v in pair]
        for fid, v in zip(ids, vals, strict=True):
            out.append(SimpleNamespace(fieldId=fid, nvmlReturn=NVML_SUCCESS,
                                       value=SimpleNamespace(ullVal=v),
                                       timestamp=1_700_000_000_000_000 + k * 10_000))
        return out

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        d = self._check(h, "pcie_throughput")
        return d.get("pcie_rate", (100, 200))[counter]

    def nvmlDeviceGetUtilizationRates(self, h):
        self._check(h, "util")
        return SimpleNamespace(gpu=55, memory=21)

    def nvmlDeviceGetClockInfo(self, h, clock):
        self._check(h, "clock")
        return 1410

    def nvmlDeviceGetPowerUsage(self, h):
        return self._check(h, "power").get("power_mw", 250_000)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._check(h, "temp")
        return 61
