"""Measure the solo running time of one op on the local device.

CPU: wall-clock timing of repeated calls with the hardware's threads per device, after warm-up,
until the inter-quartile spread is below `target_spread` of the median (or the budget is spent).
CUDA: CUDA events around each call, plus the kernels the op launches from torch.profiler.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Timing:
    median_s: float
    spread: float
    min_s: float
    repeats: int
    kernels: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


def _summary(samples: list[float]) -> tuple[float, float]:
    median = statistics.median(samples)
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [median] * 3
    return median, (q[2] - q[0]) / median if median > 0 else 0.0


def time_cpu(call: Callable[[], Any], *, min_repeats: int = 7, max_repeats: int = 200,
             target_spread: float = 0.05, budget_s: float = 1.0, warmup: int = 2) -> Timing:
    for _ in range(warmup):
        call()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < max_repeats:
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
        if len(samples) >= min_repeats and (_summary(samples)[1] <= target_spread or time.perf_counter() > deadline):
            break
    median, spread = _summary(samples)
    return Timing(median, spread, min(samples), len(samples))


def time_cuda(call: Callable[[], Any], *, repeats: int = 20, warmup: int = 3) -> Timing:
    """CUDA events per call; kernel names and count from the profiler (selected when a GPU is present)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    median, spread = _summary(samples)
    return Timing(median, spread, min(samples), repeats, kernels=kernels,
                  metrics={"device": torch.cuda.get_device_name(), "kernel_count": len(kernels)})
