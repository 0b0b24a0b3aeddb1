"""Ground-truth timing: phases of a real step, with the communication inside them set apart."""

from __future__ import annotations

import pytest

import trainsim.workloads.observe as observe_module
from trainsim.workloads.observe import StepTimer, observer, observing


class ManualClock:
    """A perf_counter that moves only when the test says so, so expected seconds are exact sums."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def test_step_timer_separates_communication_from_compute(monkeypatch):
    clock = ManualClock()
    monkeypatch.setattr(observe_module.time, "perf_counter", clock)
    timer = StepTimer()
    with observing(timer):
        with observer().section("forward", 0, 0):
            clock.advance(0.02)
            with observer().communication():
                clock.advance(0.03)
            clock.advance(0.01)
        with observer().section("backward", 0, 0):
            clock.advance(0.02)
            with observer().communication():
                clock.advance(0.005)
        with observer().section("forward", 0, 1):  # a second microbatch adds to the same phase
            clock.advance(0.04)
            with observer().communication():
                clock.advance(0.015)
    # wall time per phase is the sum of everything inside its sections, communication included
    assert timer.phase_seconds == pytest.approx({"forward": 0.02 + 0.03 + 0.01 + 0.04 + 0.015,
                                                 "backward": 0.02 + 0.005})
    # communication is booked to the phase that encloses it, and only there
    assert timer.communication_seconds == pytest.approx({"forward": 0.03 + 0.015, "backward": 0.005})
    # compute is wall time minus communication: conserved, nothing counted twice or lost
    assert timer.compute_seconds() == pytest.approx((0.02 + 0.01 + 0.04) + 0.02)
    assert timer.compute_seconds(("backward",)) == pytest.approx(0.02)
    assert timer.compute_seconds() + sum(timer.communication_seconds.values()) == \
        pytest.approx(sum(timer.phase_seconds.values()))
