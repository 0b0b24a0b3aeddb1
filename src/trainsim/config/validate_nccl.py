"""Rules of hardware.nccl and the link fields: every value is one the collective model models.

The model (trainsim/comm/model.py) used to drop what it did not know (an algorithm it has no cost
for became ring, an unknown protocol vanished), so a config could ask for NVLS and get a ring
prediction without a word. Here such a value stops composition instead, with the field, the value
and what is supported. The supported sets are read from the model itself, so they cannot drift.
"""

from __future__ import annotations

from trainsim.config.schema import HardwareConfig, NcclConfig
from trainsim.errors import ConfigError

MAX_CHANNELS = 64
"""NCCL's MAXCHANNELS in recent releases (32 in older ones): no communicator has more channels."""


def _members(field: str, values: list[str], supported: tuple[str, ...]) -> None:
    listed = ", ".join(supported)
    if not values:
        raise ConfigError(f"{field}=[]: needs at least one; supported: {listed}")
    unknown = [v for v in values if v not in supported]
    if unknown:
        raise ConfigError(f"{field}={list(values)!r}: {', '.join(map(repr, unknown))} not modelled; "
                          f"supported: {listed}")


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def validate_nccl(nccl: NcclConfig) -> None:
    """Algorithms, protocols, version, channels and buffer of hardware.nccl."""
    from trainsim.comm.model import ALGORITHMS, PROTOCOLS, nccl_constants  # lazy: comm.model imports config

    algorithms = tuple(dict.fromkeys(a for names in ALGORITHMS.values() for a in names))
    _members("hardware.nccl.algorithms", nccl.algorithms, algorithms)
    _members("hardware.nccl.protocols", nccl.protocols, PROTOCOLS)
    if nccl.version:
        oldest = nccl_constants()["releases"][0]["from"]
        release = _release(nccl.version)
        if release is None or release < _release(oldest):
            reason = "not a release number" if release is None else f"no tuning constants before {oldest}"
            raise ConfigError(f"hardware.nccl.version={nccl.version!r}: {reason}; supported: a release from "
                              f"{oldest} on like '2.20.5', or '' (the newest constants)")
    if not 0 <= nccl.max_channels <= MAX_CHANNELS:
        raise ConfigError(f"hardware.nccl.max_channels={nccl.max_channels}: supported: 1..{MAX_CHANNELS} "
                          "(NCCL's MAXCHANNELS), or 0 (the calibration picks the count)")
    if nccl.buffer_size_bytes < 1:
        raise ConfigError(f"hardware.nccl.buffer_size_bytes={nccl.buffer_size_bytes}: must be positive "
                          "(NCCL's default is 4194304)")


def validate_links(hw: HardwareConfig) -> None:
    """Link rates and latencies: 0 means 'NCCL's constant or the datasheet default', below 0 nothing."""
    for name in ("intra_node_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s",
                 "intra_node_latency_s", "inter_node_latency_s"):
        value = getattr(hw, name)
        if value < 0:
            raise ConfigError(f"hardware.{name}={value}: must be >= 0 (0 = the model's default)")
    validate_nccl(hw.nccl)
