"""Run the reference training step for real: one process per rank, gloo over loopback on the CPU,
or NCCL with one GPU per rank when the hardware is a GPU and this machine has enough of them.

This is the ground truth the simulator is judged against on this machine, and the check that
the ex-situ trace is faithful (the same recorder can be switched on here).
"""

from __future__ import annotations

import dataclasses
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainsim.config.schema import ModelConfig, ParallelismConfig
from trainsim.parallel.layout import Layout
from trainsim.parallel.schedules import step_actions
from trainsim.processes import free_port, init_local_group, start
from trainsim.workloads.allocator import use_steady_state_allocator
from trainsim.workloads.observe import StepObserver, StepTimer, observing
from trainsim.workloads.routing import RouterCounts, RoutingHistogram, model_routing_plan
from trainsim.workloads.train_step import (
    build_rank_model,
    create_groups,
    layout_of,
    synthetic_batch,
    train_step,
)

# device kind of the hardware -> process-group backend of the real run
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def missing_gpus(par: ParallelismConfig) -> str | None:
    """Why `par` cannot run with one GPU per rank on this machine, or None when it can."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < par.world_size:
        return f"layout {par.name} needs {par.world_size} GPUs (one per rank); this machine has {have}"
    return None


def synchronize() -> None:
    """Wait for the device's queued kernels (CUDA runs asynchronously; a step ends when they are done)."""
    if torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


@dataclasses.dataclass
class RankRun:
    rank: int
    step_seconds: list[float]
    """Wall time of each measured step on this rank (after a barrier at its start)."""
    phase_seconds: list[dict[str, float]]
    """Per measured step: wall time of forward, backward and optimizer phases."""
    communication_seconds: list[dict[str, float]]
    """Per measured step and phase: time spent issuing or waiting for communication."""
    events: list[dict] | None
    """Recorded events of one extra step when recording was requested."""
    peak_memory_bytes: int | None = None
    """Most device memory the allocator held for tensors over the measured steps (CUDA's caching allocator's
    record, model states included); None on a CPU, whose allocator keeps no such record."""
    routing: RoutingHistogram | None = None
    """MoE models: tokens the router sent to each expert, per layer, over the measured steps (or over the
    recorded step when recording)."""

    def compute_seconds(self, step: int) -> float:
        """Forward + backward wall time minus the communication inside them, for one measured step."""
        return sum(self.phase_seconds[step].get(p, 0.0) - self.communication_seconds[step].get(p, 0.0)
                   for p in ("forward", "backward"))


def timed_steps(model_cfg: ModelConfig, par: ParallelismConfig, layout, rank: int, steps: int, warmup: int):
    """Build this rank's model and batches, run `warmup` + `steps` real steps, time the last `steps`.

    Runs inside an initialised process group; returns (rank model, schedule actions, batches, RankRun)
    so callers can run extra, untimed steps (recording, profiling) on the same model.
    """
    experts = model_cfg.num_experts > 0
    groups = create_groups(layout, rank, every_group=True, experts=experts)
    pos = layout.position(rank)
    histogram = RoutingHistogram() if experts else None
    force = model_routing_plan(model_cfg, par) if model_cfg.moe_force_routing else None
    kind = layout.token_group_kind
    routing = (RouterCounts(model_cfg.num_experts, groups[kind], layout.token_source(rank), histogram, force, kind)
               if experts else None)
    torch.manual_seed(1234 + pos.pp_rank * 100 + pos.tp_rank)  # replicas start identical
    rm = build_rank_model(model_cfg, par, rank, groups, routing)
    actions = step_actions(par, pos.pp_rank)
    make_batch = synthetic_batch(model_cfg, par, seed=pos.dp_rank)
    batches = [make_batch(mb) for mb in range(par.num_microbatches)]  # data loading is not in the step
    result = RankRun(rank, [], [], [], None, routing=histogram)
    on_gpu = torch.get_default_device().type == "cuda"
    for step in range(warmup + steps):
        if step == warmup:
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            if histogram is not None:
                histogram.clear()
        timer = StepTimer()
        dist.barrier()
        synchronize()
        start = time.perf_counter()
        with observing(timer):
            train_step(rm, actions, batches.__getitem__)
        synchronize()
        if step >= warmup:
            result.step_seconds.append(time.perf_counter() - start)
            result.phase_seconds.append(timer.phase_seconds)
            result.communication_seconds.append(timer.communication_seconds)
    if on_gpu:
        result.peak_memory_bytes = torch.cuda.max_memory_allocated()
    return rm, actions, batches, result


Recorder = Callable[[Layout, int], StepObserver]
"""(layout, rank) -> an observer that records one step into its `.events` and is a context manager around
it (trace.recorder.ExecutionRecorder, or a functools.partial of it with time_ops=True); picklable, as the
spawned ranks build it."""


class RankFailure(RuntimeError):
    """A spawned rank failed; the message carries every failing rank's traceback."""


def _rank_main(rank: int, body, par: ParallelismConfig, port: int, threads: int, device_kind: str, out_dir: str,
               args: tuple) -> None:
    try:
        torch.set_num_threads(threads)
        use_steady_state_allocator()
        if device_kind == "cuda":  # one GPU per rank; every tensor the step creates lands on it
            torch.cuda.set_device(rank)
            torch.set_default_device(f"cuda:{rank}")
        layout = layout_of(par)
        init_local_group(BACKENDS[device_kind], port, rank, layout.world_size)
        try:
            result = body(rank, layout, *args)
        finally:
            dist.destroy_process_group()
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def spawn_ranks(body, par: ParallelismConfig, *args, threads: int = 1, device_kind: str = "cpu") -> list:
    """Run `body(rank, layout, *args)` in one process per rank of `par` (`threads` torch threads each;
    gloo over loopback on the CPU, NCCL with one GPU per rank for 'cuda') and return each rank's result.
    `body` must be a module-level function (it is pickled to the processes). RankFailure carries the
    failing ranks' tracebacks."""
    world = par.world_size
    if device_kind not in BACKENDS:
        raise ValueError(f"device kind {device_kind!r} cannot run real steps; accepted: {', '.join(BACKENDS)}")
    if device_kind == "cuda" and (shortfall := missing_gpus(par)):
        raise RankFailure(shortfall)
    with tempfile.TemporaryDirectory(prefix="trainsim-ranks-") as out_dir:
        try:
            start(_rank_main, world, (body, par, free_port(), threads, device_kind, out_dir, args))
        except Exception as exc:
            errors = [f"rank {r}:\n{Path(out_dir, f'rank{r}.err').read_text()}" for r in range(world)
                      if Path(out_dir, f"rank{r}.err").is_file()]
            raise RankFailure("\n".join(errors) or str(exc)) from exc
        results = []
        for rank in range(world):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results


def _timed_rank(rank: int, layout, model_cfg: ModelConfig, par: ParallelismConfig, steps: int, warmup: int,
                recorder: Recorder | None) -> RankRun:
    rm, actions, batches, result = timed_steps(model_cfg, par, layout, rank, steps, warmup)
    if recorder is not None:  # an extra step: the recorder's own overhead must not distort the timings above
        dist.barrier()
        recorder = recorder(layout, rank)
        if result.routing is not None:
            result.routing.clear()
        with observing(recorder), recorder:
            train_step(rm, actions, batches.__getitem__)
        result.events = recorder.events
    return result


def _profiled_peak_rank(rank: int, layout, model_cfg: ModelConfig, par: ParallelismConfig, steps: int) -> int:
    """Most bytes this rank's CPU allocator held for tensors, from building the model through `steps` steps:
    the running total of torch.profiler's memory record (every allocation and free)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        timed_steps(model_cfg, par, layout, rank, steps, warmup=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return peak_of_memory_record([e for e in events
                                  if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0])


def peak_of_memory_record(events: list[dict]) -> int:
    """Most bytes held at once in torch.profiler's [memory] events (chrome-trace dicts: ts, args Addr, Bytes,
    Total Allocated), by address. The profiler misses some frees that gloo's threads perform (the storage of a
    collective's buffer, freed by the work that last held it; 2-rank all-gathers of 32 MiB: 192 of 288 MiB
    "allocated" after ten calls were such), so its running total only grows with each: an allocation at an
    address still live proves the storage there was freed, and it is taken out then."""
    if not events:
        return 0
    events = sorted(events, key=lambda e: e["ts"])
    first = events[0]["args"]
    total = first["Total Allocated"] - first["Bytes"]  # what was held before the record starts
    live: dict[int, int] = {}
    taken_out: set[int] = set()  # addresses whose storage was taken out at a reallocation (a late free: ignored)
    peak = total
    for event in events:
        addr, size = event["args"]["Addr"], event["args"]["Bytes"]
        if size > 0:
            if addr in live:
                total -= live[addr]
                taken_out.add(addr)
            total += size
            live[addr] = size
        elif addr in live:
            total -= live.pop(addr)
        elif addr not in taken_out:  # a storage allocated before the record
            total += size
        peak = max(peak, total)
    return peak


def measure_peak_memory(model_cfg: ModelConfig, par: ParallelismConfig, steps: int = 2) -> list[int]:
    """Per rank: the most tensor memory a real run held (the profiler's record; CPU ranks over gloo)."""
    return spawn_ranks(_profiled_peak_rank, par, model_cfg, par, steps)


def run_real_step(model_cfg: ModelConfig, par: ParallelismConfig, *, steps: int = 1, warmup: int = 0,
                  recorder: Recorder | None = None, threads_per_rank: int = 1) -> list[RankRun]:
    """Spawn dp*tp*pp processes, run `warmup + steps` timed training steps (plus one step recorded by
    `recorder(layout, rank)` when given, e.g. trace.recorder.ExecutionRecorder), return per-rank results."""
    return spawn_ranks(_timed_rank, par, model_cfg, par, steps, warmup, recorder, threads=threads_per_rank)
