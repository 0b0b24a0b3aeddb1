"""AdamW with optional mixed precision: low-precision model weights, fp32 master weights and states.

The update is torch's fused AdamW (one multi-tensor kernel for all parameters, step counters on the
device), as Megatron-LM and DeepSpeed run apex's / their own FusedAdam: the unfused foreach AdamW
keeps step counters on the host and reads each with `.item()`, two host ops per parameter that no
Megatron run has.

The mixed-precision recipe of Micikevicius et al. 2018 as Megatron-LM's Float16OptimizerWithFloat16Params
applies it: gradients are copied to fp32, Adam updates the fp32 master weights, and the result is
copied back into the bf16/fp16 model weights. Both copies are one multi-tensor op each, as Megatron
(apex's multi_tensor_scale, fp32 main_grad buffers) and DeepSpeed (flat buffers) do them: a copy per
parameter would cost the host a dispatch per parameter (~450 ops for a 12-layer GPT) that those
optimizers do not have. With fp32 gradients (Megatron's main_grad buffers, `parallelism.grad_reduce_in_fp32`)
they are the master gradients and the first copy goes. Memory per parameter: 2 (weight) + 4 (fp32 grad) + 4
(master) + 8 (Adam moments) bytes; with low-precision gradients 2 (grad) + 4 (master grad) in place of the 4.
Dynamic loss scaling for fp16 is not modelled.

Gradient clipping as Megatron's clip_grad_norm_fp32: the L2 norm of this rank's gradients (one
multi-tensor norm), squared and summed over the model-parallel group (one all-reduce: every tensor
and pipeline rank of the replica holds a different part of the gradients), then every gradient scaled
by min(1, max_norm / norm) (one multi-tensor scale). Megatron skips the scale when the factor is 1;
that choice depends on the data, so it is always issued here.

With the distributed optimizer the weights and gradients handed in are this rank's slices of the flat
parameter and gradient buffers (data_parallel.GradientBuckets), so master weights and Adam moments exist
for 1/dp of the parameters; the norm is then summed over every rank (Megatron-Core's distributed
optimizer reduces it over the whole world: each rank holds a different slice of a different stage).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainsim.workloads.observe import observer


class MixedPrecisionAdamW:
    def __init__(self, weights: list[torch.Tensor], grads: list[torch.Tensor], lr: float = 1e-4,
                 weight_decay: float = 0.01, clip_grad: float = 0.0, norm_group=None, reduce_norm: bool = False,
                 expert_tensors: int = 0, expert_norm_group=None, reduce_expert_norm: bool = False,
                 norm_copies: int = 1):
        """weights[i] is updated from grads[i] (model parameters and their gradients, or the distributed
        optimizer's slices of the flat buffers); the norm is all-reduced over `norm_group` when
        `reduce_norm` (None = every rank). The last `expert_tensors` are MoE experts' (replicated on fewer
        ranks): their squared norm is all-reduced over `expert_norm_group` apart and added, as Megatron-Core.
        norm_copies: ranks of `norm_group` holding each of these gradients (HSDP replicas, distributed-optimizer
        instances), each counting 1/norm_copies of its square, so the sum is one replica's (torchtitan's DTensor
        norm over a replicated mesh dimension, Megatron-Core's norm over one instance)."""
        self.params, self.grads = list(weights), list(grads)
        self.norm_copies = norm_copies
        self.clip_grad, self.norm_group, self.reduce_norm = clip_grad, norm_group, reduce_norm
        self.expert_tensors, self.expert_norm_group = expert_tensors, expert_norm_group
        self.reduce_expert_norm = reduce_expert_norm
        self.mixed = bool(self.params) and self.params[0].dtype != torch.float32
        # fp32 gradients (Megatron's main_grad buffers) are the master gradients themselves: no copy
        self.copy_grads = self.mixed and any(g.dtype != torch.float32 for g in self.grads)
        if self.mixed:
            self.master = [nn.Parameter(p.detach().float()) for p in self.params]
            for m, g in zip(self.master, self.grads):
                m.grad = torch.zeros_like(m) if self.copy_grads else g
        else:
            self.master = [p if isinstance(p, nn.Parameter) else nn.Parameter(p, requires_grad=False)
                           for p in self.params]
            for m, g in zip(self.master, self.grads):
                m.grad = g
        self.inner = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, fused=True)
        # Create Adam's state now rather than lazily in the first step, so every traced or timed step
        # is a steady-state step (and the state's memory is there from the start, as in Megatron-LM).
        for m in self.master:
            self.inner.state[m] = {
                "step": torch.zeros((), dtype=torch.float32, device=m.device),  # fused: on the device
                "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
            }

    def step(self) -> None:
        with torch.no_grad():
            if self.copy_grads:
                torch._foreach_copy_([m.grad for m in self.master], self.grads)
            if self.clip_grad > 0 and self.master:
                self._clip([m.grad for m in self.master])
            self.inner.step()
            if self.mixed:
                torch._foreach_copy_(self.params, self.master)

    def zero_grad(self) -> None:
        torch._foreach_zero_(self.grads)

    def _clip(self, grads: list[torch.Tensor]) -> None:
        split = len(grads) - self.expert_tensors
        squared = self._squared_norm(grads[:split], self.reduce_norm, self.norm_group, self.norm_copies)
        if self.expert_tensors:
            squared = squared + self._squared_norm(grads[split:], self.reduce_expert_norm, self.expert_norm_group)
        scale = torch.clamp(squared.rsqrt() * self.clip_grad, max=1.0)  # a zero norm gives inf -> 1
        torch._foreach_mul_(grads, scale)

    @staticmethod
    def _squared_norm(grads: list[torch.Tensor], reduce: bool, group, copies: int = 1) -> torch.Tensor:
        norms = torch.stack(torch._foreach_norm(grads))
        squared = torch.dot(norms, norms)
        if copies > 1:
            squared = squared / copies
        if reduce:
            with observer().communication():
                dist.all_reduce(squared, group=group)
        return squared

    def state_bytes(self) -> int:
        """Bytes of optimizer-owned tensors: Adam moments, plus fp32 master weights when mixed, plus their own fp32
        gradients when the model's are low-precision (12 + 4 bytes per parameter; the CUDA allocator's peak of a
        real step on an H100 showed those 4 bytes missing when only the states were counted)."""
        total = sum(t.numel() * t.element_size() for s in self.inner.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        if self.mixed:
            total += sum(m.numel() * m.element_size() for m in self.master)
        if self.copy_grads:
            total += sum(m.grad.numel() * m.grad.element_size() for m in self.master)
        return total
