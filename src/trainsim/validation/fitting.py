"""What the published-table fits share: the kernel-model parameters they move, the finite-difference step
they linearise with, and the collective and overlap-slowdown models their rows are composed with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainsim.config.schema import HardwareConfig
from trainsim.errors import ArtifactError
from trainsim.registry import STAGES

SENSITIVITY_STEP = 0.05
"""Relative change of the kernel times (vTrain: all of them; the scaling tables: one fitted parameter's) by
which a row's sensitivity to them is measured, by finite differences."""


def with_kernel_params(hw: HardwareConfig, params: dict[str, float]) -> HardwareConfig:
    """`hw` with kernel-model fields set ('kind_efficiency.<kind>' keys go into that dict) and, when given,
    host_dispatch_s."""
    host = {k: v for k, v in params.items() if k == "host_dispatch_s"}
    fields = {k: v for k, v in params.items() if "." not in k and k not in host}
    kinds = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("kind_efficiency.")}
    km = hw.kernel_model
    return dataclasses.replace(hw, **host, kernel_model=dataclasses.replace(
        km, **fields, kind_efficiency={**km.kind_efficiency, **kinds}))


def calibrated_comm(run):
    """The collective model calibrated for the run's hardware, from the calibration artifact at the registry's
    path (pipeline.build_point(run, 'calibration') builds it; validation reads, the driver builds)."""
    from trainsim.timeline.stage import comm_model

    directory = Path(STAGES["calibration"].path(run.keys))
    if not (directory / "manifest.json").is_file():
        raise ArtifactError(f"{directory}/manifest.json is missing: the published rows on hardware "
                            f"'{run.keys['hardware']}' are composed with its NCCL calibration; build it first "
                            "with trainsim.pipeline.build_point(run, 'calibration')")
    return comm_model(run.hardware, directory)


def pipeline_slowdown(run):
    """The overlap slowdown `trainsim compose` applies on the run's hardware, resolved by the compose stage's
    own function (timeline.stage.slowdown_model: hardware.slowdown.use and the model artifact at the
    registry's path; pipeline.build_point(run, 'slowdown_model') builds it). By default that is no slowdown
    until the model beats it on unseen kernel groups, so the published rows are scored as users compose."""
    from trainsim.timeline.stage import slowdown_model

    directory = Path(STAGES["slowdown_model"].path(run.keys))
    if run.hardware.slowdown.use == "none":
        return slowdown_model(run.hardware, None)
    if not (directory / "manifest.json").is_file():
        raise ArtifactError(f"{directory}/manifest.json is missing: the published rows on hardware "
                            f"'{run.keys['hardware']}' are composed with the overlap slowdown its compose would "
                            f"use (hardware.slowdown.use={run.hardware.slowdown.use}); build the model first with "
                            "trainsim.pipeline.build_point(run, 'slowdown_model')")
    return slowdown_model(run.hardware, directory)
