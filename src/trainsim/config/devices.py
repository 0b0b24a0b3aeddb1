"""Device families: which GPU a hardware config names, and what follows from the family alone.

Labels for summaries and warnings (slowdown, timeline), the generation NCCL's per-generation tables are keyed by
(comm), and the devices with NVLink SHARP (config validation). A family is matched in the device name as a whole
word ('NVIDIA A100-SXM4-80GB' -> 'A100', never 'A10').
"""

from __future__ import annotations

import re

DEVICE_FAMILIES = ("A100", "A800", "H100", "H800", "H200", "H20", "GH200", "B100", "B200", "B300", "GB200", "GB300",
                   "V100", "L40", "A40", "A30", "A10", "RTX 3090", "RTX 4090")
NVLS_DEVICES = ("H100", "H200", "H800", "GH200", "B200", "B300", "GB200", "GB300")
"""Families with NVLink SHARP (third-generation NVSwitches, sm90 and later)."""
GENERATIONS = {"V100": "volta", **dict.fromkeys(("A100", "A800", "A40", "A30", "A10"), "ampere"),
               **dict.fromkeys(("H100", "H800", "H200", "H20", "GH200"), "hopper"),
               **dict.fromkeys(("B100", "B200", "B300", "GB200", "GB300"), "blackwell")}
"""GPU family (DEVICE_FAMILIES) -> the generation NCCL's per-generation tables are keyed by."""


def gpu_generation(device_name: str) -> str:
    """'volta', 'ampere', 'hopper' or 'blackwell' from a device name ('' when it names none of them)."""
    return GENERATIONS.get(device_type_of("cuda", device_name), "")


def device_type_of(device_kind: str, device_name: str, configured: str = "") -> str:
    """The device type of a hardware config, a label for summaries and warnings (not a model feature):
    `configured` if set, 'cpu' for CPUs, else the GPU family in the name ('NVIDIA A100-SXM4-80GB' ->
    'A100'), else the name itself."""
    if configured:
        return configured
    if device_kind == "cpu":
        return "cpu"
    upper = device_name.upper()
    for family in DEVICE_FAMILIES:
        if re.search(rf"(?<![A-Z0-9]){re.escape(family)}(?![0-9])", upper):
            return family
    return device_name
