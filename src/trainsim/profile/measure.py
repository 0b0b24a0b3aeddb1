"""Measure the solo running time of one op on the local device.

CPU: wall-clock timing with the hardware's threads per device, after warm-up. Ops are timed in
interleaved rounds (every op of a batch a few times, then again, ...): a shared machine drifts (clock,
neighbours) over seconds, and interleaving spreads that drift over all ops instead of biasing
whichever op was timed during a slow spell. Median and inter-quartile spread are kept.
On a CPU whose cores are the devices, ops are timed while the node's other devices run the same
ops (co-located timing, each sample started together), since in SPMD training they all do. Timing
processes keep freed memory (`workloads/allocator.py`), as the real ranks do.
CUDA: CUDA events around each call, plus the kernels the op launches from torch.profiler.
Both: the caches are evicted before every timed call (`CacheFlush`), as nvbench and triton's do_bench
flush L2: inside a training step the layers between two uses of a weight push it out of the cache,
while an op called back to back finds its operands cached and runs too fast.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainsim import processes
from trainsim.profile.replay import build_call
from trainsim.workloads.allocator import use_steady_state_allocator

# set: how long a timing process waits for the others
BARRIER_TIMEOUT_S = 600.0


@dataclass
class Timing:
    median_s: float
    spread: float
    min_s: float
    repeats: int
    kernels: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


# set: the cache flushed between timings where the device does not say
FALLBACK_CACHE_BYTES = 32 * 1024 * 1024
"""Cache size assumed when the device does not report its last-level cache."""
# set: units of sysfs cache sizes
_SYSFS_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


def last_level_cache_bytes(device: str = "cpu") -> int:
    """Size of the device's last-level cache: L2 of a GPU, the highest cache level listed in sysfs on a CPU."""
    if device == "cuda":
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)) or FALLBACK_CACHE_BYTES
    best_level, size = 0, 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        value = int(text[:-1]) * _SYSFS_UNITS[text[-1]] if text[-1] in _SYSFS_UNITS else int(text)
        if level > best_level or (level == best_level and value > size):
            best_level, size = level, value
    return size or FALLBACK_CACHE_BYTES


class CacheFlush:
    """Writes a buffer twice the last-level cache's size, evicting what the previous call left there."""

    def __init__(self, device: str = "cpu", enabled: bool = True):
        elements = 2 * last_level_cache_bytes(device) // 4 if enabled else 0
        self.buffer = torch.zeros(elements, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        if self.buffer.numel():
            self.buffer.add_(1.0)


def _summary(samples: list[float]) -> tuple[float, float]:
    median = statistics.median(samples)
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [median] * 3
    return median, (q[2] - q[0]) / median if median > 0 else 0.0


class Lockstep:
    """Keeps co-located timing processes on the same op and the same sample.

    Each sample starts once every process has flushed its caches: with only the op in step, a peer
    writes its flush buffer (twice the last-level cache) while this process times its op, memory
    traffic that training never has. The first process (the leader) decides when a block of samples
    is long enough and the others follow, so all take the same number of samples.
    """

    def __init__(self, ctx, parties: int):
        self.barrier = ctx.Barrier(parties)
        self.decision = ctx.Array("q", 2)  # (block, samples): the leader ends `block` after `samples`
        self.block = 0
        self.taken = 0

    def wait(self) -> None:
        try:
            self.barrier.wait(BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError as exc:
            raise RuntimeError("a co-located timing process died or hung; see its traceback above") from exc

    def start_block(self) -> None:
        self.block += 1
        self.taken = 0
        self.wait()

    def take_sample(self) -> bool:
        """Wait for the others; False once the leader has ended the block after as many samples as
        this process has taken. The decision names its sample count because a process descheduled
        after the barrier may read it only after the leader has timed the next sample and decided."""
        self.wait()
        with self.decision.get_lock():
            block, samples = self.decision[:]
        if block == self.block and samples == self.taken:
            return False
        self.taken += 1
        return True

    def finish_block(self) -> None:
        with self.decision.get_lock():
            self.decision[:] = [self.block, self.taken]


def time_cpu(calls: list[Callable[[], Any]], *, rounds: int = 3, min_samples: int = 3,
             min_seconds: float = 0.005, max_samples: int = 100, warmup: int = 1,
             flush: Callable[[], Any] = lambda: None, lockstep: Lockstep | None = None,
             leader: bool = True, progress: Callable[[int, int], None] | None = None) -> list[Timing]:
    """Time each call: `rounds` passes over all calls, each taking at least `min_samples` samples
    and `min_seconds` of wall time (at most `max_samples`) before moving to the next.
    `progress(done, total)` is called after each call's block of samples (total: rounds x calls).

    `flush` runs before every sample, untimed (a `CacheFlush`). With a `lockstep` shared by
    co-located processes running the same calls, every sample of an op starts in all of them at once;
    the `leader` decides how many samples a block takes.
    """
    if lockstep:
        lockstep.start_block()
    for call in calls:
        for _ in range(warmup):
            call()
    samples: list[list[float]] = [[] for _ in calls]
    blocks = 0
    for _ in range(rounds):
        for call, taken in zip(calls, samples):
            if lockstep:
                lockstep.start_block()
            begin = time.perf_counter()
            for n in range(max_samples):
                flush()
                if lockstep and not lockstep.take_sample():
                    break
                start = time.perf_counter()
                call()
                taken.append(time.perf_counter() - start)
                if n + 1 >= min_samples and time.perf_counter() - begin >= min_seconds:
                    if lockstep is None:
                        break
                    if leader:
                        lockstep.finish_block()
            blocks += 1
            if progress:
                progress(blocks, rounds * len(calls))
    timings = []
    for taken in samples:
        median, spread = _summary(taken)
        timings.append(Timing(median, spread, min(taken), len(taken)))
    return timings


def _colocated_worker(rows: list[dict], lockstep: Lockstep, threads: int, flush_caches: bool) -> None:
    torch.set_num_threads(threads)
    use_steady_state_allocator()
    time_cpu([build_call(row) for row in rows], flush=CacheFlush("cpu", flush_caches), lockstep=lockstep,
             leader=False)


def time_cpu_colocated(rows: list[dict], calls: list[Callable[[], Any]], devices: int, threads: int,
                       flush_caches: bool = True, progress: Callable[[int, int], None] | None = None
                       ) -> list[Timing]:
    """Time `calls` (built from `rows`) while `devices - 1` other processes run the same ops in lockstep.

    CPU "devices" are cores that share caches and memory bandwidth; in SPMD training every rank of a
    node runs the same op at about the same time, so an op timed alone on an idle machine is too fast.
    """
    use_steady_state_allocator()  # as the real ranks run (workloads/allocator.py)
    flush = CacheFlush("cpu", flush_caches)
    if devices <= 1:
        return time_cpu(calls, flush=flush, progress=progress)
    ctx = processes.context()
    lockstep = Lockstep(ctx, devices)
    workers = [ctx.Process(target=_colocated_worker, args=(rows, lockstep, threads, flush_caches), daemon=True)
               for _ in range(devices - 1)]
    for worker in workers:
        worker.start()
    try:
        return time_cpu(calls, flush=flush, lockstep=lockstep, progress=progress)
    finally:
        for worker in workers:
            worker.join(BARRIER_TIMEOUT_S)
            if worker.is_alive():
                worker.kill()


def time_cuda(call: Callable[[], Any], *, repeats: int = 20, warmup: int = 3,
              flush: Callable[[], Any] = lambda: None) -> Timing:
    """CUDA events per call, `flush` (a CacheFlush on the GPU) before each, outside the events;
    kernel names and count from the profiler (selected when a GPU is present).

    The events time the device from the call's issue to its last kernel's end, which for an op made of many
    small kernels includes the host's issue gaps between them. Recorded beside it (`metrics`), to tell the two
    apart: `kernel_s`, the profiled call's kernels' summed durations (device busy time, no gaps); `graph_s`, the
    median of the call captured once in a CUDA graph and replayed between the same events (null when the op
    cannot be captured); `host_s`, the median host time to issue one call on an idle device."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    samples, host = [], []
    for _ in range(repeats):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issued = time.perf_counter()
        call()
        host.append(time.perf_counter() - issued)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    flush()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    median, spread = _summary(samples)
    return Timing(median, spread, min(samples), repeats, kernels=[e.name for e in kernels],
                  metrics={"device": torch.cuda.get_device_name(), "kernel_count": len(kernels),
                           "kernel_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
                           "graph_s": _time_cuda_graph(call, repeats, flush), "host_s": statistics.median(host)})


def measured_kernel_point(call: Callable[[], Any], flush: Callable[[], Any]) -> tuple[dict[str, float], Timing]:
    """One call timed with time_cuda, as the measured kernel files in data/kernels record it: event_ms (CUDA events
    around an eager call), kernel_ms (its kernels summed), graph_ms (CUDA-graph replays; NaN where the call cannot
    be captured), kernels (how many); and the Timing (kernel names)."""
    timing = time_cuda(call, flush=flush)
    graph_s = timing.metrics["graph_s"]
    return {"event_ms": 1e3 * timing.median_s, "kernel_ms": 1e3 * timing.metrics["kernel_s"],
            "graph_ms": float("nan") if graph_s is None else 1e3 * graph_s,
            "kernels": timing.metrics["kernel_count"]}, timing


def write_measurements(out: Path, header: list[str], rows: list[dict]) -> None:
    """`rows` as CSV under `header` (comment lines naming the source, hardware and timing), written atomically."""
    import pandas as pd

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(header) + "\n" + pd.DataFrame(rows).to_csv(index=False))
    tmp.replace(out)
    print(f"wrote {len(rows)} points to {out}")


@functools.cache
def _warmup_stream(device: int) -> torch.cuda.Stream:
    """The one side stream every capture warms up on. The caching allocator reuses a freed block only on the
    stream that allocated it, and cuBLAS keeps a workspace per stream: a new stream per op stranded both (on an
    H200, 134 GiB reserved and 1 GiB of workspaces after 1,962 ops, with 1 GiB of live tensors)."""
    return torch.cuda.Stream(device)


def _time_cuda_graph(call: Callable[[], Any], repeats: int, flush: Callable[[], Any]) -> float | None:
    """Median seconds of `call` captured in a CUDA graph and replayed, or None if it cannot be captured.

    A capture that fails part-way (an op that synchronises with the host: an `.item()`, a copy to the CPU,
    an output sized by its values) ends before CUDA's default random generator leaves capture mode, and
    every random number drawn afterwards in the process fails ("Offset increment outside graph capture"),
    rebuilt inputs and dropout included: the generator's state is put back from a copy taken before. The graph's
    private memory pool is released before returning, captured or not (kept, it holds the op's outputs and
    workspace: over hundreds of ops a profiling process ran out of memory)."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    state = generator.clone_state()
    side = _warmup_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            call()  # warm on the side stream, as capture requires
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            call()
    except (RuntimeError, TypeError):  # not capturable
        torch.cuda.synchronize()
        generator.graphsafe_set_state(state)
        graph.reset()
        return None
    samples = []
    for _ in range(repeats):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    graph.reset()
    return statistics.median(samples)

