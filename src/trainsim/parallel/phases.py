"""The phases of a training step's ops: what the step observer announces, the recorder stores and the
composer reads back. A forward and a backward run interleaved form a combined pass (workloads/combined_passes.py)."""

from __future__ import annotations

PHASES = ("forward", "backward", "optimizer")
COMBINED = "combined"
"""The pass of a forward and a backward run interleaved (combined_passes.py); its ops' phases are
'combined.forward' and 'combined.backward'."""


def pass_of(phase: str) -> str:
    """The pass an op's phase belongs to: 'combined' for both halves of a combined pass, else the phase."""
    return COMBINED if phase.startswith(COMBINED + ".") else phase


def direction_of(phase: str) -> str:
    """'forward', 'backward' or 'optimizer': what the op does, in a combined pass or not."""
    return phase.removeprefix(COMBINED + ".")
