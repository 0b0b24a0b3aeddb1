"""Hooks through which a recorder sees the structure of a training step.

The training step announces what it is doing (phase, model chunk, micro-batch; work done once per
step rather than once per micro-batch). Real runs use the null observer; the trace recorder
installs itself with `observing(recorder)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

from trainsim.parallel.phases import direction_of


class StepObserver:
    """Default observer: ignores everything (the cost of a real step is unchanged)."""

    @contextlib.contextmanager
    def section(self, phase: str, chunk: int, microbatch: int) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def once_per_step(self) -> Iterator[None]:
        """Work that runs only on the last micro-batch (gradient sync) rather than on every one."""
        yield

    def released(self, tensor) -> None:
        """The step freed `tensor`'s storage (resized to nothing) and keeps the tensor for autograd alone."""

    @contextlib.contextmanager
    def communication(self, async_op: bool = False, group_kind: str | None = None,
                      stands_for: tuple | None = None) -> Iterator[None]:
        """The step is issuing or waiting for communication (time here is not computation); async_op: the
        calls return at once and the step waits for them later, where it uses their results; group_kind:
        the kind (layout.GROUP_KINDS) of the group used, where another kind's group has the same ranks (the
        context-parallel ring is the gradient group when dp = 1); stands_for: (outputs, inputs) of the call
        the one inside stands in for, where the backend cannot run it as such (collectives.all_gather_uneven)."""
        yield

    @contextlib.contextmanager
    def kernel_notes(self, **notes: float) -> Iterator[None]:
        """What the kernel model needs to know about the kernels issued here that their arguments on the tracing
        device do not show: `comm_sms`, a communication kernel holds that many SMs meanwhile (Transformer Engine's
        comm-GEMM overlap); `comm_kernel`, the op is that communication kernel's own work (a reduction it does on
        its SMs); `dropout_p`, the fused attention drops probabilities inside the kernel (a CPU's kernel cannot);
        `fused`, the op's work is done inside the kernel that produced its input (Transformer Engine's FP8 cast
        also records the amax and writes the transpose); `to_host` / `from_host`, the op copies a tensor to host
        memory or back (activation offloading: a copy stream, the host link's bandwidth)."""
        yield

    def kernel_notes_for_backward(self, output, **notes: float) -> None:
        """kernel_notes for the kernels autograd runs to differentiate `output` (its grad_fn)."""

    def padded(self, tensor, real_bytes: int) -> None:
        """`tensor` is a padded copy the tracing device's kernel needs and the GPU's does not (torch's CPU flash
        attention wants v as wide as q): where it is kept for backward it counts `real_bytes`."""

    def kept_for_backward(self, tensor) -> None:
        """The step keeps `tensor` for its backward outside autograd's saved tensors (an op output selective
        checkpointing keeps: workloads/op_checkpoint.py)."""


class StepTimer(StepObserver):
    """Wall time per phase, and the part of it spent in communication calls (ground truth on CPU)."""

    def __init__(self) -> None:
        self.phase_seconds: dict[str, float] = {}
        self.communication_seconds: dict[str, float] = {}
        self._phase = "setup"

    @contextlib.contextmanager
    def section(self, phase: str, chunk: int, microbatch: int) -> Iterator[None]:
        previous, self._phase = self._phase, direction_of(phase)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[self._phase] = self.phase_seconds.get(self._phase, 0.0) + time.perf_counter() - start
            self._phase = previous

    @contextlib.contextmanager
    def communication(self, async_op: bool = False, group_kind: str | None = None,
                      stands_for: tuple | None = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.communication_seconds[self._phase] = self.communication_seconds.get(self._phase, 0.0) + elapsed

    def compute_seconds(self, phases: tuple[str, ...] = ("forward", "backward")) -> float:
        """Wall time of `phases` minus the communication inside them."""
        return sum(self.phase_seconds.get(p, 0.0) - self.communication_seconds.get(p, 0.0) for p in phases)


_NULL_OBSERVER = StepObserver()
_current: contextvars.ContextVar[StepObserver | None] = contextvars.ContextVar("trainsim_observer", default=None)


def observer() -> StepObserver:
    return _current.get() or _NULL_OBSERVER


@contextlib.contextmanager
def observing(obs: StepObserver) -> Iterator[StepObserver]:
    token = _current.set(obs)
    try:
        yield obs
    finally:
        _current.reset(token)
