"""How far to trust a predicted step time: an interval built from each cost model's measured held-out error,
propagated through the step's critical path (interval.py; the measured errors in component_errors.yaml)."""

from trainsim.uncertainty.interval import (
    NOMINAL_LEVELS,
    ComponentError,
    StepInterval,
    component_errors,
    step_interval,
)

__all__ = ["NOMINAL_LEVELS", "ComponentError", "StepInterval", "component_errors", "step_interval"]
