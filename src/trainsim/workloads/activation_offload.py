"""CPU activation offloading as Megatron-Core runs it (--cpu-offloading-num-layers, activations only: Transformer
Engine's CPU offload context around each transformer layer).

The tensors the model's first N layers save for backward go to host memory during forward and come back during
backward, so their device memory is free in between: Transformer Engine's rule, every saved tensor but parameters,
tensors under 256 Ki elements and non-contiguous views (those stay on the device, and a view keeps its whole
storage there). Each copy is its own op, noted `to_host` or
`from_host` (observer.kernel_notes), which the recorder puts on the device-to-host and host-to-device copy streams
and the kernel model prices at hardware.host_link_bandwidth_bytes_per_s. A layer's tensors start back when the
backward of the layer after it starts (the gradient of that layer's output arrives), one layer ahead of their
use, as Transformer Engine prefetches; the compute waits for a copy only where it reads the tensor. The compute
stream never waits for a copy to the host: Transformer Engine frees a layer's device copies layers later, after
the copy has long finished.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from trainsim.workloads.observe import observer

MIN_OFFLOADED_ELEMENTS = 256 * 1024  # cite: Transformer Engine cpu_offload.py _check_if_offload
"""Smaller saved tensors stay on the device."""


class _Offloaded:
    """A saved tensor's host copy, and its device copy once reloaded."""

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host, self.device, self.reloaded = host, device, None

    def reload(self) -> torch.Tensor:
        if self.reloaded is None:
            with observer().kernel_notes(from_host=1.0):
                self.reloaded = self.host.to(self.device, copy=True, non_blocking=True)
            self.host = None
        return self.reloaded


class ActivationOffload:
    """Offloads the saved tensors of the layers it is entered for (`layer(index)`), one record per layer."""

    def __init__(self) -> None:
        self._layers: dict[int, list[_Offloaded]] = {}

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """The forward of layer `index`: its saved tensors go to the host."""
        offloaded = self._layers.setdefault(index, [])

        def pack(t: torch.Tensor):
            base = t._base if t._base is not None else t
            if isinstance(base, nn.Parameter) or t.numel() < MIN_OFFLOADED_ELEMENTS or not t.is_contiguous():
                observer().kept_for_backward(t)
                return t
            with observer().kernel_notes(to_host=1.0):
                entry = _Offloaded(t.to("cpu", copy=True, non_blocking=True), t.device)
            offloaded.append(entry)
            return entry

        def unpack(packed):
            return packed.reload() if isinstance(packed, _Offloaded) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def reload_when_differentiated(self, index: int, output: torch.Tensor) -> None:
        """Bring layer `index`'s tensors back when the gradient of `output` (the next layer's output) arrives: the
        start of that layer's backward."""
        if output.requires_grad:
            output.register_hook(lambda grad: self._reload(index))

    def _reload(self, index: int) -> None:
        for entry in self._layers.pop(index, []):
            entry.reload()
