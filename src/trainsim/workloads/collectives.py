"""The flat all-gather and reduce-scatter of torch.distributed under the names of the installed torch.

torch 2.13 calls them all_gather_single / reduce_scatter_single (and warns on the old names); the older
releases the project accepts (pyproject: torch >= 2.6, e.g. the 2.11 CUDA build of a GPU machine) have
only all_gather_into_tensor / reduce_scatter_tensor. Both dispatch to the same c10d ops, so traces agree.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""(output [world * n, ...], input [n, ...], group=..., async_op=...)"""
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""(output [n, ...], input [world * n, ...], group=..., async_op=...)"""
