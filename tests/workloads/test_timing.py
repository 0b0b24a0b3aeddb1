"""Ground-truth timing: phases of a real step, with the communication inside them set apart."""

from __future__ import annotations

import time

from trainsim.workloads.observe import StepTimer, observer, observing


def test_step_timer_separates_communication_from_compute():
    timer = StepTimer()
    with observing(timer):
        with observer().section("forward", 0, 0):
            time.sleep(0.02)
            with observer().communication():
                time.sleep(0.03)
        with observer().section("backward", 0, 0):
            time.sleep(0.02)
    assert timer.phase_seconds["forward"] >= 0.05
    assert timer.communication_seconds == {"forward": timer.communication_seconds["forward"]}
    assert 0.035 <= timer.compute_seconds() < 0.06
