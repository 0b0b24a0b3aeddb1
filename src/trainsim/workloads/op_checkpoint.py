"""Op-level selective activation checkpointing, as torchtitan runs it (`activation_checkpoint.mode = "selective"`,
`selective_ac_option = "op"`, the default of its Llama 3 8B config; parallelism.recompute 'op').

Each block runs under PyTorch's selective checkpointing (torch.utils.checkpoint.create_selective_checkpoint_contexts)
with torchtitan's policy: the outputs of the block's matmuls, of the fused attention and of the amax reductions of
FP8 scaling are kept for the backward, except every second matmul of the block; everything else (norms, rotary,
activation functions, casts, the skipped matmuls and the all-gathers) runs again in the backward.
torchtitan counts aten.mm, which is also what a torchao Float8 linear reaches the policy as (its tensor subclass
turns mm into _scaled_mm below the policy); here the FP8 GEMMs are dispatched as _scaled_mm or block_scaled_mm
directly, so they count as matmuls too.

The tensor-parallel reduce-scatters' results are kept too, as torchtitan keeps those of
`_c10d_functional.reduce_scatter_tensor` (the all-gathers run again). With the model's separate projections
(model.separate_projections: torchtitan's wq, wk, wv, wo, w1, w3, w2) "every second matmul" recomputes wk, wo and
w3 of each block, as in torchtitan.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import trainsim.workloads.block_scaling  # noqa: F401  (registers trainsim::block_scaled_mm)
from trainsim.workloads.observe import observer

# cite: torchtitan parallelize_llama.py `_save_list` (2024-12 and 2025-06): aten.mm, the SDPA kernels,
# _c10d_functional.reduce_scatter_tensor, aten.max (and aten.abs) of FP8 scaling; every second mm recomputed
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten._scaled_mm.default,
           torch.ops.trainsim.block_scaled_mm.default}
KEPT = {torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten.linalg_vector_norm.default,  # fp8._amax: torchao's max(abs(x))
        torch.ops.aten.max.default, torch.ops.aten.abs.default, torch.ops.aten.alias.default}
"""Ops whose outputs the policy keeps (besides every other matmul and the reduce-scatters). aten.alias: the alias
tensor_parallel.reduce_scatter_tokens returns its kept sum through (the in-place collective's buffer is not refilled
where the reduce-scatter is kept)."""


def _is_reduce_scatter(func) -> bool:
    """A c10d reduce-scatter (torchtitan keeps _c10d_functional.reduce_scatter_tensor's result)."""
    return func.namespace == "c10d" and "reduce_scatter" in func._overloadpacket.__name__


def _policy(counts: dict[str, int], ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func in MATMULS:
        mode = "recompute" if ctx.is_recompute else "forward"
        counts[mode] += 1
        keep = counts[mode] % 2 == 1
    else:
        keep = func in KEPT or _is_reduce_scatter(func)
    if keep and not ctx.is_recompute:  # (op_output: torch >= 2.7; before, kept outputs go uncounted)
        for t in tree_flatten(getattr(ctx, "op_output", None))[0]:
            if isinstance(t, torch.Tensor):
                observer().kept_for_backward(t)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def op_checkpoint_contexts():
    """The forward and recompute contexts of one block's checkpoint (torch.utils.checkpoint's context_fn): a fresh
    matmul count per block, as torchtitan's. A kept output may be changed in place after it was kept (an FP8 amax
    all-reduced over the tensor-parallel group): the recompute then reads the changed value, as the forward did."""
    return create_selective_checkpoint_contexts(partial(_policy, defaultdict(int)), allow_cache_entry_mutation=True)
