"""System noise: identical ranks do not reach a blocking collective at the same time.

Ranks running the same program between two synchronisations still finish at different times: the OS,
other tenants and the memory system interrupt each of them independently (system noise; Petrini et al.,
SC'03; Hoefler et al., SC'10). A blocking collective starts when the last rank arrives, so every
synchronisation of n ranks after T seconds of compute costs E[max over ranks] - E[one rank] on top of
the transfer. With each rank's segment time normal with standard deviation sigma(T), that wait is
sigma(T) * e_n, e_n the expected maximum of n standard normals (e_2 = 0.564, e_8 = 1.42).

sigma(T) = scale * T^exponent inside the measured range of T; beyond it the deviation grows like
sqrt(T) (independent increments), since long windows average out bursts that short ones catch whole.

The local sweep measures it (`measure_local`): the ranks run the same compute burst of T seconds, then
a one-element all-reduce, many times per T; the mean |t_a - t_b| of two ranks' burst times gives sigma
(for normals E|X - Y| = 2 sigma / sqrt(pi)). GPUs time their kernels far more steadily than a shared
VM's cores; their hardware configs have no measurement and the wait is zero.
"""

from __future__ import annotations

import functools
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from trainsim.processes import free_port, init_local_group, start

# set: the local noise measurement's burst lengths, repeats and duration
SEGMENTS_S = (0.01, 0.04, 0.16, 0.64)
"""Burst lengths of the local measurement: a tensor-parallel layer's segment up to a pipeline stage's."""
# set: the local noise measurement's duration per burst length
SECONDS_PER_SEGMENT = 3.0
# set: the local noise measurement's fewest repeats
MIN_REPEATS = 8


@functools.cache
def expected_max_std_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by quadrature of n x phi(x) Phi(x)^(n-1)."""
    if n < 2:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return float(np.trapezoid(x * n * pdf * cdf ** (n - 1), x))


@dataclass(frozen=True)
class SystemNoise:
    """sigma(T) = scale * T^exponent up to max_segment_s, sqrt(T) growth beyond (module doc)."""

    scale: float
    exponent: float
    max_segment_s: float

    def sigma_s(self, segment_s: float) -> float:
        if segment_s <= 0:
            return 0.0
        if segment_s <= self.max_segment_s:
            return self.scale * segment_s ** self.exponent
        return self.scale * self.max_segment_s ** self.exponent * math.sqrt(segment_s / self.max_segment_s)

    def sync_wait_s(self, segment_s: float, num_ranks: int) -> float:
        """Expected wait for the last of `num_ranks` ranks after `segment_s` of compute each."""
        return self.sigma_s(segment_s) * expected_max_std_normal(num_ranks)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SystemNoise:
        return cls(float(data["scale"]), float(data["exponent"]), float(data["max_segment_s"]))


def fit_noise(table: pd.DataFrame) -> SystemNoise:
    """Least squares in log space of sigma = sqrt(pi)/2 * mean |difference| against the segment length."""
    sigma = math.sqrt(math.pi) / 2 * table["mean_abs_difference_s"].to_numpy(dtype=float)
    segment = table["segment_s"].to_numpy(dtype=float)
    keep = (sigma > 0) & (segment > 0)
    if keep.sum() < 2:
        raise ValueError(f"system noise needs two segment lengths with a measured spread, got {keep.sum()}")
    exponent, log_scale = np.polyfit(np.log(segment[keep]), np.log(sigma[keep]), 1)
    return SystemNoise(float(math.exp(log_scale)), float(exponent), float(segment[keep].max()))


def _burst(iterations: int, a, b) -> None:
    for _ in range(iterations):
        a @ b


def _noise_worker(rank: int, world: int, port: int, segments: tuple[float, ...], seconds_per_segment: float,
                  out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_group("gloo", port, rank, world)
    try:
        a, b = torch.rand(128, 128), torch.rand(128, 128)
        _burst(20, a, b)
        start = time.perf_counter()
        _burst(200, a, b)
        per_call = torch.tensor([(time.perf_counter() - start) / 200])
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)  # every rank runs the same number of calls
        flag, rows = torch.zeros(1), []
        for segment in segments:
            iterations = max(1, round(segment / float(per_call)))
            repeats = max(MIN_REPEATS, round(seconds_per_segment / segment))
            times = torch.zeros(repeats, dtype=torch.float64)
            dist.barrier()
            for r in range(repeats):
                begin = time.perf_counter()
                _burst(iterations, a, b)
                times[r] = time.perf_counter() - begin
                dist.all_reduce(flag)  # the blocking synchronisation the next burst starts from
            gathered = [torch.zeros_like(times) for _ in range(world)]
            dist.all_gather(gathered, times)
            if rank == 0:
                both = torch.stack(gathered).numpy()
                rows.append({"segment_s": float(both.mean()), "repeats": repeats, "num_ranks": world,
                             "mean_abs_difference_s": float(np.abs(both[0] - both[1]).mean()),
                             "relative_sd": float(both.std(axis=1).mean() / both.mean())})
        if rank == 0:
            pd.DataFrame(rows).to_parquet(out)
    finally:
        dist.destroy_process_group()


def measure_local(segments: tuple[float, ...] = SEGMENTS_S, seconds_per_segment: float = SECONDS_PER_SEGMENT
                  ) -> pd.DataFrame:
    """Two processes on this machine (gloo over loopback), one thread each: per burst length, the mean
    |difference| of the two ranks' times for the same work (columns segment_s, mean_abs_difference_s,
    relative_sd, repeats, num_ranks)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="trainsim-noise-") as tmp:
        out = str(Path(tmp) / "noise.parquet")
        start(_noise_worker, 2, (2, port, tuple(segments), seconds_per_segment, out))
        return pd.read_parquet(out)
