"""Vendors' dense matmul peaks (no sparsity) by GPU name, in FLOP/s: the denominator of MFU
beside the peak `gputrace probe` measured. Figures from NVIDIA's data sheets (boost clock;
SXM parts at their full power)."""

from __future__ import annotations

import re

T = 1e12

# (pattern on the device name as NVML or torch gives it, our name, {dtype: dense FLOP/s});
# the first pattern that matches names the part
PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H200", "H200", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T,
                       "fp16": 989.4 * T}),
    (r"H100.*(PCIe|PCIE)", "H100 PCIe", {"fp32": 51.2 * T, "tf32": 378 * T, "bf16": 756 * T,
                                         "fp16": 756 * T}),
    (r"H100.*NVL", "H100 NVL", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T,
                                "fp16": 835.5 * T}),
    (r"H100", "H100 SXM", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T,
                           "fp16": 989.4 * T}),
    (r"A100.*(PCIe|PCIE)", "A100 PCIe", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T,
                                         "fp16": 312 * T}),
    (r"A100", "A100 SXM", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T,
                           "fp16": 312 * T}),
    (r"L40S", "L40S", {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362 * T, "fp16": 362 * T}),
    (r"\bL4\b", "L4", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T}),
    (r"A10\b", "A10", {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T}),
    (r"V100.*(PCIe|PCIE)", "V100 PCIe", {"fp32": 14 * T, "fp16": 112 * T}),
    (r"V100", "V100 SXM2", {"fp32": 15.7 * T, "fp16": 125 * T}),
    (r"\bT4\b", "T4", {"fp32": 8.1 * T, "fp16": 65 * T}),
)


def vendor_peak(device_name: str | None, dtype: str | None) -> tuple[str, float] | None:
    """(the part's name, its dense peak for `dtype`), None for a part or dtype not listed."""
    if not device_name or not dtype:
        return None
    for pattern, name, peaks in PEAKS:
        if re.search(pattern, device_name):
            return (name, peaks[dtype]) if dtype in peaks else None
    return None
