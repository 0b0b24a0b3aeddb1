"""A steady-state host allocator for CPU runs: freed memory is kept for reuse, not returned to the OS.

glibc serves large blocks with mmap and unmaps them when freed, and trims the heap's top, so every
training step page-faults its activations afresh (the kernel zeroes each 4 KiB page), and two ranks
doing it at once contend for it. GPU training has no such cost: CUDA's caching allocator keeps freed
blocks. Real runs and op timing on a CPU therefore both run with a steady-state heap (`mallopt`: no
mmap, no trimming), as PyTorch's CPU performance guide gets from jemalloc or tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# cite: glibc's malloc.h
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's malloc.h
# set: the heap's growth per request
TOP_PAD_BYTES = 64 << 20
"""Heap growth per request: fewer sbrk calls while the first step builds the steady state."""


def use_steady_state_allocator() -> bool:
    """Switch this process's glibc malloc to keep what it frees; False where that is not glibc on Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and mallopt(M_TOP_PAD, TOP_PAD_BYTES))
