"""Worker processes: started from a fork server that has imported torch and trainsim's training code once.

Every real run, collective sweep, colocated kernel timing and parallel trace starts 2-4 processes. Under
the 'spawn' start method each of them imports torch and the workloads afresh (4-5 s per process on a
2-core CI machine); a fork server imports them once per parent process and forks every worker from it
(about 0.03 s). The server runs no compute, so no thread pool is forked. Workers inherit the server's
environment, taken when it started, not the parent's at the time of the start: whatever a worker needs
travels as an argument or is set in the worker (`init_local_group`).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable

START_METHOD = "forkserver"
PRELOAD = ["__main__", "torch", "torch.distributed", "trainsim.workloads.launch"]
"""Imported by the fork server before it forks any worker (one that fails to import is left to the workers)."""


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context every trainsim worker starts from."""
    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts: the first worker of this process
    return ctx


def start(fn: Callable[..., None], nprocs: int, args: tuple, join: bool = True):
    """torch.multiprocessing.spawn(fn, args, nprocs, join) from the fork server: `fn(index, *args)` in each."""
    import torch.multiprocessing as mp

    context()  # the server loads PRELOAD when this first start launches it
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method=START_METHOD)


def free_port() -> int:
    """A TCP port free on loopback now, for a gloo rendezvous of spawned processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_group(backend: str, port: int, rank: int, world_size: int) -> None:
    """Join the process group of `world_size` workers on this machine (gloo over loopback, or NCCL)."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
