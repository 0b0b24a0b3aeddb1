"""Measure collectives on this machine (gloo) or a cluster (NCCL under torchrun), nccl-tests style.

Each (collective, size) is run `warmup` times, then `iters` times back to back; the time per call is
the slowest rank's average (as nccl-tests reports it). Sizes follow nccl-tests' semantics (see
nccl_tests.py): all_gather's size is the gathered output, reduce_scatter's the input, all_to_all a
rank's whole send buffer. The result has the columns of the nccl-tests parser, so both feed the same
calibration.

On a cluster:  torchrun --nnodes 2 --nproc-per-node 8 -m trainsim.comm.sweep --output sweep.parquet
(NCCL and CUDA devices are chosen when a GPU is present; otherwise gloo on CPU tensors).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from trainsim.comm.nccl_tests import COLUMNS, bus_bandwidth_factor
from trainsim.processes import free_port, init_local_group
from trainsim.progress import feed, spawn, tracked

SWEEP_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
DTYPE = torch.float32


def default_sizes(min_bytes: int = 1024, max_bytes: int = 16 << 20) -> list[int]:
    """Powers of two from min_bytes to max_bytes, like nccl-tests -b/-e/-f 2."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def collective_call(collective: str, size_bytes: int, device: torch.device):
    """A zero-argument callable running one collective of nccl-tests size `size_bytes`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    elements = max(size_bytes // DTYPE.itemsize // world * world, world)  # divisible by the world size
    full = torch.ones(elements, dtype=DTYPE, device=device)
    part = torch.ones(elements // world, dtype=DTYPE, device=device)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full)
    if collective == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    if collective == "broadcast":
        return lambda: dist.broadcast(full, src=0)
    if collective == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    if collective == "send_recv":  # each rank sends to the next and receives from the previous (sendrecv_perf)
        recv = torch.empty_like(full)

        def exchange():
            ops = [dist.P2POp(dist.isend, full, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return exchange
    raise ValueError(f"collective {collective!r}; accepted: {', '.join(SWEEP_COLLECTIVES)}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_batch_seconds(call, device: torch.device, iters: int, repeats: int) -> float:
    """Median over `repeats` batches of the slowest rank's mean time per call in a batch of `iters`.

    The median keeps one batch disturbed by the OS scheduler (ranks > cores) from deciding the result.
    """
    batches = []
    for _ in range(repeats):
        _synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        _synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank decides
        batches.append(float(elapsed.item()))
    return float(np.median(batches))


def sweep_points(collectives: list[str], sizes: list[int], world: int) -> int:
    """How many (collective, size) points `measure` times (send_recv needs 2 ranks)."""
    return sum(len(sizes) for c in collectives if not (c == "send_recv" and world < 2))


def measure(collectives: list[str], sizes: list[int], iters: int = 10, warmup: int = 3,
            repeats: int = 3, progress: Callable[[int, int], None] | None = None) -> pd.DataFrame | None:
    """Run the sweep inside an initialised process group; rank 0 returns the table, others None.

    `progress(done, total)` is called after each (collective, size) point.
    """
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # *_tensor renames
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    source = f"trainsim sweep {dist.get_backend()} {world} ranks on {socket.gethostname()}"
    rows = []
    for collective in collectives:
        if collective == "send_recv" and world < 2:
            continue
        for size in sizes:
            call = collective_call(collective, size, device)
            for _ in range(warmup):
                call()
            time_s = _median_batch_seconds(call, device, iters, repeats)
            algbw = size / time_s / 1e9
            rows.append({"collective": collective, "message_bytes": size, "dtype": "fp32",
                         "placement": "out_of_place", "time_s": time_s, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * bus_bandwidth_factor(collective, world), "source": source})
            if progress:
                progress(len(rows), sweep_points(collectives, sizes, world))
    if dist.get_rank() != 0:
        return None
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", "1")))
    return table.assign(nranks=world, nodes=nodes)


def _local_worker(rank: int, slot, world: int, port: int, collectives, sizes, iters, warmup, repeats,
                  out: str) -> None:
    torch.set_num_threads(1)
    init_local_group("gloo", port, rank, world)
    try:  # rank 0 reports its points; the parent draws the bar
        table = measure(collectives, sizes, iters, warmup, repeats, progress=feed(slot) if rank == 0 else None)
        if table is not None:
            table.to_parquet(out)
    finally:
        dist.destroy_process_group()


def run_local_sweep(world: int, collectives: list[str] = SWEEP_COLLECTIVES, sizes: list[int] | None = None,
                    iters: int = 10, warmup: int = 3, repeats: int = 3) -> pd.DataFrame:
    """Spawn `world` processes on this machine (gloo over loopback) and measure."""
    if world < 1:
        raise ValueError(f"world={world} must be at least 1")
    unknown = set(collectives) - set(SWEEP_COLLECTIVES)
    if unknown:
        raise ValueError(f"unknown collective(s) {sorted(unknown)}; accepted: {', '.join(SWEEP_COLLECTIVES)}")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="trainsim-sweep-") as tmp:
        out = str(Path(tmp) / "sweep.parquet")
        sizes = sizes or default_sizes()
        spawn(_local_worker, world, (world, port, list(collectives), sizes, iters, warmup, repeats, out),
              f"sweeping collectives over {world} gloo rank(s)", sweep_points(list(collectives), sizes, world))
        return pd.read_parquet(out)


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point: the process group comes from torchrun's environment."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, type=Path, help="Parquet file written by rank 0")
    parser.add_argument("--collectives", default=",".join(SWEEP_COLLECTIVES))
    parser.add_argument("--sizes", help="comma-separated byte sizes (default: 1 KiB .. 16 MiB, powers of two)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="timed batches; the median is kept")
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else default_sizes()
        collectives = args.collectives.split(",")
        bar = tracked(f"sweeping collectives over {dist.get_world_size()} {backend} rank(s)",
                      sweep_points(collectives, sizes, dist.get_world_size()))
        with bar if dist.get_rank() == 0 else contextlib.nullcontext() as update:  # one bar, rank 0's
            table = measure(collectives, sizes, args.iters, args.warmup, args.repeats, progress=update)
        if table is not None:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            table.to_parquet(args.output)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
