"""Stage 6, timeline compose: the event-driven replay of one training step over all rank classes."""

from trainsim.timeline.compose import StepTimeline, compose_step
from trainsim.timeline.costs import CommCost, ConstantSlowdown, NoSlowdown, SlowdownEstimate, TableComm
from trainsim.timeline.plugins import register_dependency_rule, register_schedule
from trainsim.timeline.step import TimelineError

__all__ = ["CommCost", "ConstantSlowdown", "NoSlowdown", "SlowdownEstimate", "StepTimeline",
           "TableComm", "TimelineError", "compose_step", "register_dependency_rule", "register_schedule"]
