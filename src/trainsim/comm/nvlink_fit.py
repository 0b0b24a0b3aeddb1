"""Learn NVLINK_EFFICIENCY (comm/network.py), the intra-node prior of a GPU without a single-node measurement.

Each source is one large ring all-reduce on one 8-GPU node. Its time, less the model's local buffer work
(LOCAL_ACCESSES bytes at memory bandwidth per message byte), is the ring's bus bytes over the achieved NVLink
rate; that rate over the datasheet's is the source's efficiency, and the prior is their mean (two digits).
A held-out figure on a source file takes the mean without it (`without`), as the network priors do.

    python -m trainsim.comm.nvlink_fit    # each source's efficiency, and whether NVLINK_EFFICIENCY is current
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainsim.comm.calibration import read_calibration_file
from trainsim.comm.model import LOCAL_ACCESSES
from trainsim.comm.nccl_tests import bus_bandwidth_factor
from trainsim.comm.network import NVLINK_EFFICIENCY
from trainsim.config import compose_run
from trainsim.config.schema import CalibrationFile


@dataclass(frozen=True)
class RingAllReduce:
    """One measured ring all-reduce of `message_bytes` on `ranks` GPUs of one node of `hardware`."""

    path: str
    hardware: str
    message_bytes: int
    ranks: int = 8
    algorithm: str = "auto"
    """The calibration reader's algorithm of the curve: 'auto' (NCCL's choice), or the one the table states NCCL
    ran when another was switched off (comm/busbw_tables.py: the ring of 'NCCL_NVLS_ENABLE=0')."""


# cite: the two measured files named below (data/SOURCES.md), each at the message size its source reports
SOURCES = (
    RingAllReduce("data/nccl-tests/a100-8gpu-nvlink_allreduce_vtrain-lut.csv", "a100-80g-dgx", 1 << 30),
    RingAllReduce("data/nccl-tests/h200-8gpu-nvlink_allreduce-nvls-vs-ring_mlengineering.txt", "h200-sxm-dgx",
                  16 << 30, algorithm="ring"),
)
"""vTrain's A100 table at 1 GiB, ml-engineering's H200 ring (NVLS off) at 16 GiB (data/SOURCES.md)."""


def measured_seconds(source: RingAllReduce) -> float:
    table = read_calibration_file(CalibrationFile(path=source.path), "nvlink_fit.SOURCES")
    row = table[(table["message_bytes"] == source.message_bytes) & (table["num_ranks"] == source.ranks)
                & (table["algorithm"] == source.algorithm)]
    if row.empty:
        raise ValueError(f"{source.path}: no {source.ranks}-rank {source.algorithm} all-reduce of "
                         f"{source.message_bytes} B (nvlink_fit.SOURCES)")
    return float(row["time_s"].iloc[0])


def source_efficiency(source: RingAllReduce) -> float:
    """Achieved NVLink rate over the datasheet's, once the local buffer work is taken out of the time."""
    hw = compose_run([f"hardware={source.hardware}"], check="layout").hardware
    local_s = LOCAL_ACCESSES["all_reduce"] * source.message_bytes / hw.memory_bandwidth_bytes_per_s
    link_s = measured_seconds(source) - local_s
    return bus_bandwidth_factor("all_reduce", source.ranks) * source.message_bytes / (
        link_s * hw.intra_node_bandwidth_bytes_per_s)


def nvlink_efficiency(without=()) -> float:
    """The prior: the mean efficiency over the sources whose file is none of `without` (compared by name),
    to two digits."""
    held = {Path(p).name for p in without}
    kept = [s for s in SOURCES if Path(s.path).name not in held]
    if not kept:
        raise ValueError(f"no NVLink source left without {sorted(held)} (nvlink_fit.SOURCES)")
    return round(float(np.mean([source_efficiency(s) for s in kept])), 2)


def main() -> int:
    for source in SOURCES:
        print(f"{source.path}: {source_efficiency(source):.3f}")
    learned = nvlink_efficiency()
    print(f"mean {learned:.2f}; NVLINK_EFFICIENCY {NVLINK_EFFICIENCY} is "
          f"{'current' if learned == NVLINK_EFFICIENCY else 'OUT OF DATE (edit comm/network.py)'}")
    return 0 if learned == NVLINK_EFFICIENCY else 1


if __name__ == "__main__":
    sys.exit(main())
