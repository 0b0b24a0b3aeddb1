"""Hooks through which a recorder sees the structure of a training step.

The training step announces what it is doing (phase, model chunk, micro-batch; work done once per
step rather than once per micro-batch). Real runs use the null observer; the trace recorder
installs itself with `observing(recorder)`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

PHASES = ("forward", "backward", "optimizer")


class StepObserver:
    """Default observer: ignores everything (the cost of a real step is unchanged)."""

    @contextlib.contextmanager
    def section(self, phase: str, chunk: int, microbatch: int) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def once_per_step(self) -> Iterator[None]:
        """Work that runs only on the last micro-batch (gradient sync) rather than on every one."""
        yield


_current: contextvars.ContextVar[StepObserver] = contextvars.ContextVar("trainsim_observer", default=StepObserver())


def observer() -> StepObserver:
    return _current.get()


@contextlib.contextmanager
def observing(obs: StepObserver) -> Iterator[StepObserver]:
    token = _current.set(obs)
    try:
        yield obs
    finally:
        _current.reset(token)
