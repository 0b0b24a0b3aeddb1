"""Rules of hardware.nccl, hardware.network and the link fields: every value is one the collective model models.

The model (trainsim/comm/model.py) used to drop what it did not know (an algorithm it has no cost
for became ring, an unknown protocol vanished), so a config could ask for NVLS and get a ring
prediction without a word. Here such a value stops composition instead, with the field, the value
and what is supported. The supported sets are config/choices.py's, which the model reads too, so they cannot drift.
"""

from __future__ import annotations

from trainsim.config.choices import NCCL_ALGORITHMS, OLDEST_NCCL_RELEASE, PLACEMENTS, PROTOCOLS, TRANSPORTS
from trainsim.config.devices import NVLS_DEVICES
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
    _members("hardware.nccl.algorithms", nccl.algorithms, NCCL_ALGORITHMS)
    _members("hardware.nccl.protocols", nccl.protocols, PROTOCOLS)
    if nccl.version:
        oldest = OLDEST_NCCL_RELEASE
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
    validate_network(hw)


NVLS_FROM = (2, 17)
"""NCCL release that introduced NVLS (NVLink SHARP all-reduce)."""
NVLS_COMPUTE_CAPABILITY = 9
"""NVLink SHARP needs third-generation NVSwitches: Hopper (sm90) and later."""


def validate_network(hw: HardwareConfig) -> None:
    """hardware.network: a topology that can exist and a transport and reductions the model and NCCL have."""
    net, field = hw.network, "hardware.network"
    if net.transport not in ("", *TRANSPORTS):
        raise ConfigError(f"{field}.transport={net.transport!r}: supported: {', '.join(TRANSPORTS)}, or '' (unknown: "
                          "NCCL's network constants and the nominal bandwidth)")
    for name in ("nics_per_node", "nic_bandwidth_bytes_per_s", "nvlink_domain_size", "nodes_per_leaf"):
        if getattr(net, name) < 0:
            raise ConfigError(f"{field}.{name}={getattr(net, name)}: must be >= 0 (0 = unknown)")
    if bool(net.nics_per_node) != bool(net.nic_bandwidth_bytes_per_s):
        raise ConfigError(f"{field}.nics_per_node={net.nics_per_node} and {field}.nic_bandwidth_bytes_per_s="
                          f"{net.nic_bandwidth_bytes_per_s:g}: give both (the node's bandwidth is their product) "
                          "or neither")
    total = net.nics_per_node * net.nic_bandwidth_bytes_per_s
    if total and hw.inter_node_bandwidth_bytes_per_s and abs(total / hw.inter_node_bandwidth_bytes_per_s - 1) > 0.01:
        raise ConfigError(f"hardware.inter_node_bandwidth_bytes_per_s={hw.inter_node_bandwidth_bytes_per_s:g} "
                          "contradicts "
                          f"{field}.nics_per_node x nic_bandwidth_bytes_per_s = {net.nics_per_node} x "
                          f"{net.nic_bandwidth_bytes_per_s:g} = {total:g}; set one of them (or 0)")
    domain, devices = net.nvlink_domain_size, hw.devices_per_node
    if domain and devices and domain % devices:  # a job smaller than a domain, or not a multiple of it, is fine
        raise ConfigError(f"{field}.nvlink_domain_size={domain}: must be a multiple of devices_per_node={devices} "
                          "(a domain joins whole nodes/trays); 0 = one node per domain")
    if net.placement not in PLACEMENTS:
        raise ConfigError(f"{field}.placement={net.placement!r}: supported: {', '.join(PLACEMENTS)} ('balanced': the "
                          "job's nodes spread evenly over the fewest NVLink domains; 'packed': fill one domain first)")
    if net.oversubscription < 1:
        raise ConfigError(f"{field}.oversubscription={net.oversubscription}: must be >= 1 (1 = non-blocking; 2 = 2:1)")
    nvls_asked = "nvls" in hw.nccl.algorithms
    if nvls_asked and not net.nvls:
        raise ConfigError(f"hardware.nccl.algorithms={list(hw.nccl.algorithms)} includes 'nvls' but {field}.nvls is "
                          "false; set it true for NVSwitches with NVLink SHARP (H100 and later) or drop 'nvls'")
    if net.nvls:
        if hw.device_kind != "cuda" or not any(name in hw.device_name for name in NVLS_DEVICES):
            raise ConfigError(f"{field}.nvls=true needs NVLink SHARP (sm{NVLS_COMPUTE_CAPABILITY}0 or later: "
                              f"{', '.join(NVLS_DEVICES)}); hardware.device_name={hw.device_name!r}")
        release = _release(hw.nccl.version)
        if release is not None and release < NVLS_FROM:
            raise ConfigError(f"{field}.nvls=true needs NCCL {NVLS_FROM[0]}.{NVLS_FROM[1]} or later; "
                              f"hardware.nccl.version={hw.nccl.version!r}")
