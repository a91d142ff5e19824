"""The dense BF16 peak of known accelerators, for MFU."""

from __future__ import annotations

from typing import Final

#: Dense (no sparsity) BF16 tensor-core peak per device, in TFLOPS, from each
#: vendor's published datasheet. Matched against the device name, longest key
#: first, case-insensitively. See docs/insight.md for the sources.
PEAK_BF16_TFLOPS: Final[dict[str, float]] = {
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L4": 121.0,
    "L40S": 362.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H800": 989.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "MI250X": 383.0,
    "MI300X": 1307.0,
    "MI325X": 1307.0,
    "TPU v4": 275.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v6e": 918.0,
}


def peak_for(name: str | None) -> float | None:
    if not name or not isinstance(name, str):
        return None
    text = name.lower()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in text:
            return PEAK_BF16_TFLOPS[key]
    return None


def peak_tflops(accelerator: str) -> float | None:
    """The dense BF16 peak of a device named like ``"NVIDIA H100 80GB HBM3"``, or None."""
    return peak_for(accelerator)
