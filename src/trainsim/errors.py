"""Project exceptions: user input errors are ValueErrors; infeasible layouts are counted by sweeps."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, its value and what is accepted."""


class LayoutInfeasible(RuntimeError):
    """A valid layout that cannot run (out of memory, no such topology); sweeps count these."""


class ArtifactError(RuntimeError):
    """An artifact is missing, half-written or corrupt; the message names the file."""


class TraceError(RuntimeError):
    """The sub-model or training step of one rank could not be built or traced; names the rank."""


class ReplayError(RuntimeError):
    """A traced op cannot be rebuilt and run for measurement (custom, data-dependent, unsupported dtype)."""
