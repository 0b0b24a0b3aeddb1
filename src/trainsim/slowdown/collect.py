"""Measure the slowdown dataset on this machine: compute ops solo and while a collective runs.

Two ranks on this machine (gloo over loopback; NCCL on two GPUs). Rank 0 measures, rank 1 is the
collective's peer. For every window (compute op x collective x message size x repeat):

1. solo: rank 0 calls the op `solo_calls` times after one warm-up call (rank 1 idles at a barrier);
   the median is the op's solo time.
2. overlapped: both ranks start the collective. On rank 0 it is issued from a background thread
   (CPU; gloo does the work in its own threads, the calling thread only waits) or on a separate CUDA
   stream (GPU), while the main thread/stream calls the op back to back until the collective ends
   (at most `max_calls_per_window` calls). Every call is one instance.

The collective's interval [start, end] is taken around the call on the communication thread (CPU,
perf_counter) or by CUDA events on its stream (GPU); each compute call's interval likewise. The
overlap fraction of an instance is |call ∩ collective| / |call|: calls inside the collective have
r = 1, the last one usually r < 1, and one that began after the collective ended r = 0 (kept,
status 'zero_overlap'). On a CPU the "device" is a core: the compute thread, gloo's threads and the
peer share the machine's cores, caches and memory bandwidth, which is the contention measured.
"""

from __future__ import annotations

import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainsim.comm.sweep import collective_call
from trainsim.config.schema import SlowdownConfig
from trainsim.errors import ConfigError, ReplayError
from trainsim.processes import free_port, init_local_group
from trainsim.profile.analytical import op_kind
from trainsim.profile.replay import build_call
from trainsim.progress import feed, spawn
from trainsim.slowdown.dataset import check_instances

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# set: bytes per fp32 element
FP32 = 4
# name -> (aten op, function of (x, y, w) on a [rows, 1024] fp32 input x, extra input y, weight w).
# FLOPs and bytes follow the trace recorder: FLOPs = output elements, bytes = inputs + outputs.
# set: the ops the local overlap dataset measures
MEMORY_BOUND_OPS: dict[str, tuple[str, Callable]] = {
    "add": ("aten::add.Tensor", lambda x, y, w: torch.add(x, y)),
    "mul": ("aten::mul.Tensor", lambda x, y, w: torch.mul(x, y)),
    "gelu": ("aten::gelu", lambda x, y, w: F.gelu(x)),
    "softmax": ("aten::_softmax", lambda x, y, w: torch.softmax(x, dim=-1)),
    "layer_norm": ("aten::native_layer_norm", lambda x, y, w: F.layer_norm(x, (x.shape[-1],), w, w)),
    "sum": ("aten::sum.dim_IntList", lambda x, y, w: x.sum(dim=-1)),
    "clone": ("aten::clone", lambda x, y, w: x.clone()),
}
# set: the row width of the local overlap dataset's inputs
ROW = 1024


@dataclass
class ComputeOp:
    op: str
    flops: float
    bytes_moved: float
    call: Callable[[], object]


def sweep_ops(cfg: SlowdownConfig, device: torch.device) -> list[ComputeOp]:
    """The configured matrix multiplies (n x n x n) and memory-bound ops (elements) as callables."""
    unknown = [name for name in cfg.memory_bound_ops if name not in MEMORY_BOUND_OPS]
    if unknown:
        raise ConfigError(f"hardware.slowdown.memory_bound_ops has unknown op(s) {unknown}; "
                          f"accepted: {sorted(MEMORY_BOUND_OPS)}")
    ops = []
    for n in cfg.matmul_sizes:
        a, b = torch.rand(n, n, device=device), torch.rand(n, n, device=device)
        ops.append(ComputeOp("aten::mm", 2.0 * n**3, 3.0 * n * n * FP32, lambda a=a, b=b: torch.mm(a, b)))
    for elements in cfg.memory_bound_elements:
        rows = max(elements // ROW, 1)
        x, y = torch.rand(rows, ROW, device=device), torch.rand(rows, ROW, device=device)
        w = torch.ones(ROW, device=device)
        for name in cfg.memory_bound_ops:
            aten, fn = MEMORY_BOUND_OPS[name]
            out = fn(x, y, w)
            inputs = [x, y] if name in ("add", "mul") else [x, w, w] if name == "layer_norm" else [x]
            moved = sum(t.numel() for t in inputs) * FP32 + out.numel() * FP32
            ops.append(ComputeOp(aten, float(out.numel()), float(moved), lambda fn=fn, x=x, y=y, w=w: fn(x, y, w)))
    return ops


def profile_ops(rows: pd.DataFrame, device: torch.device) -> tuple[list[ComputeOp], list[dict]]:
    """Replayable ops of profile-database rows; the others are returned with the reason."""
    ops, skipped = [], []
    for row in rows.to_dict("records"):
        try:
            ops.append(ComputeOp(row["op"], float(row["flops"]), float(row["bytes_moved"]), build_call(row, device)))
        except ReplayError as exc:
            skipped.append({"op": row["op"], "signature": row.get("signature", ""), "reason": str(exc)})
    return ops, skipped


def _comm_call(collective: str, message_bytes: int, device: torch.device) -> Callable[[], None]:
    """One collective of nccl-tests size (all_gather: the gathered output; reduce_scatter: the input)."""
    if collective not in COLLECTIVES:
        raise ConfigError(f"hardware.slowdown.collectives has {collective!r}; accepted: {', '.join(COLLECTIVES)}")
    return collective_call(collective, message_bytes, device)


def _overlap(c0: float, c1: float, s: float, e: float) -> float:
    return max(0.0, min(c1, e) - max(c0, s)) / (c1 - c0) if c1 > c0 else 0.0


def _window_cpu(op: ComputeOp, comm: Callable[[], None], cap: int) -> tuple[list[tuple[float, float]], float, float]:
    """Call the op back to back while `comm` runs in a thread; (call intervals, comm start, comm end)."""
    span: dict[str, float] = {}
    started, done = threading.Event(), threading.Event()

    def communicate() -> None:
        span["start"] = time.perf_counter()
        started.set()
        comm()
        span["end"] = time.perf_counter()
        done.set()

    thread = threading.Thread(target=communicate, daemon=True)
    thread.start()
    started.wait()
    calls = []
    while len(calls) < cap:
        c0 = time.perf_counter()
        op.call()
        calls.append((c0, time.perf_counter()))
        if done.is_set():
            break
    thread.join()
    return calls, span["start"], span["end"]


def _window_cuda(op: ComputeOp, comm: Callable[[], None], cap: int, solo_s: float,
                 comm_solo_s: float) -> tuple[list[tuple[float, float]], float, float]:
    """GPU: the collective on its own stream (NCCL), the op on the default stream; times from CUDA events."""
    stream, ref = torch.cuda.Stream(), torch.cuda.Event(enable_timing=True)
    comm_events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    calls = min(cap, int(np.ceil(comm_solo_s / max(solo_s, 1e-9))) + 1)
    op_events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    torch.cuda.synchronize()
    ref.record()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        comm_events[0].record(stream)
        comm()  # NCCL runs on its own internal stream, ordered after `stream` and joined back into it
        comm_events[1].record(stream)
    for start, end in op_events:
        start.record()
        op.call()
        end.record()
    torch.cuda.synchronize()
    ms = 1e-3
    intervals = [(ref.elapsed_time(s) * ms, ref.elapsed_time(e) * ms) for s, e in op_events]
    return intervals, ref.elapsed_time(comm_events[0]) * ms, ref.elapsed_time(comm_events[1]) * ms


def _time_solo(op: ComputeOp, calls: int, device: torch.device) -> float:
    op.call()
    samples = []
    for _ in range(calls):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op.call()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            op.call()
            samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def _comm_solo(comm: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    comm()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure_windows(ops: list[ComputeOp], cfg: SlowdownConfig, device: torch.device,
                    progress: Callable[[int, int], None] | None = None) -> list[dict] | None:
    """Run every window inside an initialised 2+-rank group; rank 0 returns its instances, others None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for collective in cfg.collectives:  # warm-up: lazy initialisation of each collective stays out of the data
        for message_bytes in cfg.message_bytes:
            _comm_call(collective, message_bytes, device)()
    windows = [(i, c, m, k) for k in range(cfg.repeats) for c in cfg.collectives for m in cfg.message_bytes
               for i in range(len(ops))]
    for w, (i, collective, message_bytes, repeat) in enumerate(windows):
        comm = _comm_call(collective, message_bytes, device)
        dist.barrier()
        solo = _time_solo(ops[i], cfg.solo_calls, device) if rank == 0 else 0.0
        dist.barrier()
        if rank != 0:
            for _ in range(2 if device.type == "cuda" else 1):  # on a GPU, rank 0 first times one call alone
                comm()
            continue
        if device.type == "cuda":
            comm_solo = _comm_solo(comm, device)  # sizes the GPU window; rank 1 runs a matching extra call
            calls, start, end = _window_cuda(ops[i], comm, cfg.max_calls_per_window, solo, comm_solo)
        else:
            calls, start, end = _window_cpu(ops[i], comm, cfg.max_calls_per_window)
        for j, (c0, c1) in enumerate(calls):
            rows.append({"instance_id": f"w{w}-c{j}", "op": ops[i].op, "flops": ops[i].flops,
                         "bytes_moved": ops[i].bytes_moved, "collective": collective, "message_bytes": message_bytes,
                         "num_ranks": world, "repeat": repeat, "solo_duration_s": solo,
                         "overlapped_duration_s": c1 - c0, "overlap_fraction": _overlap(c0, c1, start, end)})
        if progress:
            progress(w + 1, len(windows))
    return rows if rank == 0 else None


def _worker(rank: int, slot, world: int, port: int, cfg: SlowdownConfig, threads: int, profile_rows,
            out: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    torch.set_num_threads(threads)
    cuda = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_local_group("nccl" if cuda else "gloo", port, rank, world)
    try:
        ops = sweep_ops(cfg, device)
        skipped: list[dict] = []
        if profile_rows is not None and len(profile_rows):
            extra, skipped = profile_ops(profile_rows, device)
            ops += extra
        rows = measure_windows(ops, cfg, device, progress=feed(slot) if rank == 0 else None)  # parent's bar
        if rows is not None:
            frame = pd.DataFrame(rows).assign(source=f"measured-{device.type}", channels=np.nan, algorithm="",
                                              protocol="")
            frame.to_parquet(out)
            pd.DataFrame(skipped, columns=["op", "signature", "reason"]).to_parquet(out + ".skipped")
    finally:
        dist.destroy_process_group()


def collect_local(cfg: SlowdownConfig, hardware: str, device_type: str, threads_per_device: int = 1,
                  profile_rows: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict[str, int], list[dict]]:
    """Measure on this machine with 2 ranks; (valid instances, invalid counts, skipped profile ops)."""
    if cfg.repeats < 1 or cfg.solo_calls < 1 or cfg.max_calls_per_window < 1:
        raise ConfigError(f"hardware.slowdown: repeats={cfg.repeats}, solo_calls={cfg.solo_calls} and "
                          f"max_calls_per_window={cfg.max_calls_per_window} must be at least 1")
    bad = [c for c in cfg.collectives if c not in COLLECTIVES]
    if bad or not cfg.collectives or not cfg.message_bytes:
        raise ConfigError(f"hardware.slowdown.collectives={list(cfg.collectives)} / message_bytes="
                          f"{list(cfg.message_bytes)}: need at least one of each, collectives among {COLLECTIVES}")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="trainsim-slowdown-") as tmp:
        out = str(Path(tmp) / "instances.parquet")
        spawn(_worker, 2, (2, port, cfg, threads_per_device, profile_rows, out),
              f"timing compute under collectives ({device_type}, 2 ranks)")
        raw, skipped = pd.read_parquet(out), pd.read_parquet(out + ".skipped").to_dict("records")
    raw = raw.assign(hardware=hardware, device_type=device_type, kernel_name="", op_kind=raw["op"].map(op_kind))
    valid, invalid_counts, _ = check_instances(raw)
    return valid, invalid_counts, skipped
