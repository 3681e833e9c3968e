"""Dense matrix-multiply peaks of the GPUs fleetscope knows, per numeric type, from the vendors' datasheets: what
a GEMM's achieved rate is compared with (analysis/per_rank/step_work.py) and the trainer's MFU is computed
against (trainer/flops.py). A device not listed gets the achieved rate alone."""

from __future__ import annotations

from typing import Any

TFLOPS = dict[str, float]
_PEAKS: tuple[tuple[tuple[str, ...], str, TFLOPS], ...] = (
    # (needles all in the lowercased device name, the device, {precision: dense TFLOP/s})
    (("h200",), "H200", {"fp32": 67.0, "tf32": 494.7, "bf16/fp16": 989.4, "fp8": 1978.9}),
    (("h100", "pcie"), "H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16/fp16": 756.0, "fp8": 1513.0}),
    (("h100",), "H100 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16/fp16": 989.4, "fp8": 1978.9}),
    (("b200",), "B200", {"tf32": 1100.0, "bf16/fp16": 2250.0, "fp8": 4500.0}),
    (("a100",), "A100", {"fp32": 19.5, "tf32": 156.0, "bf16/fp16": 312.0}),
    (("a10g",), "A10G", {"fp32": 31.2, "tf32": 62.5, "bf16/fp16": 125.0}),
    (("l40s",), "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16/fp16": 362.1, "fp8": 733.0}),
    (("mi300x",), "MI300X", {"fp32": 163.4, "tf32": 653.7, "bf16/fp16": 1307.4, "fp8": 2614.9}),
    (("v100",), "V100", {"fp32": 15.7, "bf16/fp16": 125.0}),
)
"""NVIDIA H100/H200, B200, A100, A10G, L40S and V100 SXM2 datasheets and AMD's MI300X datasheet, without
sparsity. H200 and H100 SXM share the compute (they differ in memory); the V100's half-precision peak is fp16
(it has no bf16)."""
BF16 = "bf16/fp16"


def device_name(device_properties: Any, device: int | None = None) -> str:
    """The GPU's name from a trace's `deviceProperties` (the entry of `device`, else the first named one);
    "" where the trace has none."""
    if not isinstance(device_properties, list):
        return ""
    named = [d for d in device_properties if isinstance(d, dict) and isinstance(d.get("name"), str)]
    for entry in named:
        if device is not None and entry.get("id") == device:
            return entry["name"]
    return named[0]["name"] if named else ""


def peak_tflops(name: str) -> tuple[str, TFLOPS]:
    """(the device as listed, its dense peaks) for a device name; ("", {}) for one not listed."""
    folded = name.lower()
    for needles, device, peaks in _PEAKS:
        if all(needle in folded for needle in needles):
            return device, peaks
    return "", {}


_HOST_LINKS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    # (needles all in the lowercased device name, the link, pinned host<->device GB/s one direction achieves)
    (("h200",), "PCIe Gen5 x16", 50.0),
    (("h100",), "PCIe Gen5 x16", 50.0),
    (("b200",), "PCIe Gen5 x16", 50.0),
    (("mi300x",), "PCIe Gen5 x16", 50.0),
    (("a100",), "PCIe Gen4 x16", 25.0),
    (("a10g",), "PCIe Gen4 x16", 25.0),
    (("l40s",), "PCIe Gen4 x16", 25.0),
    (("v100",), "PCIe Gen3 x16", 12.0),
)
"""The host link of the GPUs fleetscope knows and what a pinned copy over it moves per second: about 80% of the
link's 64 / 32 / 16 GB/s per direction (Gen5 / Gen4 / Gen3 x16), what bandwidth tests measure on these systems.
A trace's own pinned copies, where it has large ones, are the better figure (analysis/per_rank/step_work.py)."""


def pinned_copy_gbps(name: str) -> tuple[str, float]:
    """(the host link, the GB/s a pinned copy over it reaches) for a device name; ("", 0.0) for one not listed."""
    folded = name.lower()
    for needles, link, rate in _HOST_LINKS:
        if all(needle in folded for needle in needles):
            return link, rate
    return "", 0.0


_PEER_LINKS: dict[str, tuple[str, float]] = {
    # the device as _PEAKS lists it -> (its link to the other GPUs of its node, GB/s per direction)
    "H200": ("NVLink 4 (18 links x 25 GB/s)", 450.0),
    "H100 SXM": ("NVLink 4 (18 links x 25 GB/s)", 450.0),
    "B200": ("NVLink 5 (18 links x 50 GB/s)", 900.0),
    "A100": ("NVLink 3 (12 links x 25 GB/s)", 300.0),
    "V100": ("NVLink 2 (6 links x 25 GB/s)", 150.0),
    "MI300X": ("Infinity Fabric (7 links x 64 GB/s)", 448.0),
    "H100 PCIe": ("PCIe Gen5 x16 (no NVLink bridge assumed)", 64.0),
    "A10G": ("PCIe Gen4 x16", 32.0),
    "L40S": ("PCIe Gen4 x16", 32.0),
}
"""The GPUs' links inside a node, per direction, from the vendors' datasheets (SXM / OAM parts, where a part
comes in both): the peak a collective's bus bandwidth is compared with. An A100 whose name says PCIe gets its
PCIe link (a bridge between two cards cannot be seen in the name)."""


def peer_link(name: str) -> tuple[str, str, float]:
    """(the device as listed, its link inside a node, GB/s per direction) for a device name; ("", "", 0.0) for
    one not listed."""
    device, _ = peak_tflops(name)
    folded = name.lower()
    if device == "A100" and "pcie" in folded:
        return device, "PCIe Gen4 x16", 32.0
    link, rate = _PEER_LINKS.get(device, ("", 0.0))
    return (device, link, rate) if link else ("", "", 0.0)
