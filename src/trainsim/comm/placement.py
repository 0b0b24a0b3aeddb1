"""Where a job's ranks sit: which NVLink domain each global rank is in, as a scheduler places the job.

The collective model's "node" is the NVLink domain (comm/network.py): a group whose ranks share one runs over
NVLink, one that spans domains over the network. With 8-GPU DGX nodes a domain is a node and rank r is in
domain r // 8. A rack-scale domain (GB200/GB300 NVL72: 18 trays of 4 GPUs) is usually larger than the job or
not a divisor of it, so the answer depends on how the scheduler lays the job's trays over racks
(hardware.network.placement):

* 'balanced': the job's trays spread evenly over the fewest domains that hold them (the first T mod D domains
  one tray more), as Slurm's topology/block plugin places a job split into equal segments and as NVL72 jobs
  are run in practice (256 GPUs = 4 racks x 16 trays, leaving 2 trays per rack spare). A power-of-two group
  then lines up with the racks: on 256 GPUs a data-parallel group of 64 with stride 4 spans 4 racks, one of
  stride 1 stays in one.
* 'packed': fill a domain before the next (72 + 72 + 72 + 40 on 256 GPUs).

Ranks fill trays in order (rank r is on the job's tray r // devices_per_node), as launchers number them.
This module is the one place that answers "which domain is rank r in"; comm, timeline and search ask it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainsim.comm.network import domain_size
from trainsim.config.schema import HardwareConfig


@dataclass(frozen=True)
class JobPlacement:
    """A job of `world_size` ranks laid over NVLink domains of `domain_devices` GPUs (trays of
    `devices_per_node`) by `policy`."""

    world_size: int
    devices_per_node: int
    domain_devices: int
    policy: str = "balanced"
    domain_of_rank: np.ndarray = field(init=False, repr=False, compare=False)
    """Domain index of each global rank 0..world_size-1."""

    def __post_init__(self) -> None:
        per_node = max(self.devices_per_node, 1)
        nodes = -(-max(self.world_size, 1) // per_node)
        nodes_per_domain = max(self.domain_devices // per_node, 1)
        domains = -(-nodes // nodes_per_domain)
        node = np.arange(max(self.world_size, 1)) // per_node
        if self.policy == "packed":
            domain_of_node = np.arange(nodes) // nodes_per_domain
        else:  # balanced: the first nodes % domains domains hold one node more
            nodes_in = nodes // domains + (np.arange(domains) < nodes % domains)
            domain_of_node = np.repeat(np.arange(domains), nodes_in)
        object.__setattr__(self, "domain_of_rank", domain_of_node[node])

    @property
    def domains(self) -> int:
        """NVLink domains the job touches."""
        return int(self.domain_of_rank[-1]) + 1

    def domain_of(self, ranks) -> np.ndarray:
        """Domain index of each of `ranks` (global ranks of this job)."""
        return self.domain_of_rank[np.asarray(ranks, dtype=np.int64)]

    def domains_spanned(self, ranks) -> int:
        """NVLink domains a group of global ranks touches: the collective model's node count for it."""
        return len(np.unique(self.domain_of(list(ranks))))


def job_placement(hw: HardwareConfig, world_size: int) -> JobPlacement:
    """How a job of world_size ranks sits on hw's NVLink domains (hardware.network.placement)."""
    return JobPlacement(world_size, hw.devices_per_node, domain_size(hw), hw.network.placement)
