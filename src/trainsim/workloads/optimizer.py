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
optimizers do not have. Memory per parameter: 2 (weight) + 2 (grad) + 4 (master) + 8 (Adam moments)
bytes. Dynamic loss scaling for fp16 is not modelled.
"""

from __future__ import annotations

import torch
from torch import nn


class MixedPrecisionAdamW:
    def __init__(self, params: list[nn.Parameter], lr: float = 1e-4, weight_decay: float = 0.01):
        self.params = [p for p in params if p.requires_grad]
        self.mixed = bool(self.params) and self.params[0].dtype != torch.float32
        if self.mixed:
            self.master = [nn.Parameter(p.detach().float()) for p in self.params]
            for m in self.master:
                m.grad = torch.zeros_like(m)
        else:
            self.master = self.params
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
            if self.mixed:
                torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.params])
            self.inner.step()
            if self.mixed:
                torch._foreach_copy_(self.params, self.master)

    def state_bytes(self) -> int:
        """Bytes of optimizer-owned tensors: Adam moments, plus fp32 master weights when mixed."""
        total = sum(t.numel() * t.element_size() for s in self.inner.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        if self.mixed:
            total += sum(m.numel() * m.element_size() for m in self.master)
        return total
