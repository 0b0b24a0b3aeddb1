"""Configuration: typed schemas, Hydra composition, validation and sweep expansion."""

from trainsim.config.compose import Run, compose_run, default_config_dir, group_from_plain, stable_hash
from trainsim.config.schema import HardwareConfig, ModelConfig, NcclConfig, ParallelismConfig

__all__ = [
    "HardwareConfig",
    "ModelConfig",
    "NcclConfig",
    "ParallelismConfig",
    "Run",
    "compose_run",
    "default_config_dir",
    "group_from_plain",
    "stable_hash",
]
