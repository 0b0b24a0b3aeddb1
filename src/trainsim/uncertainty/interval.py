"""An interval on every step time, from each cost model's own held-out errors.

A composed step is the sum of its critical path: compute (kernels, host time, the bubble, which is other stages'
compute), collectives and all-to-alls. Each of these is predicted by a model whose error on data it was not fitted
on has been measured (component_errors.yaml, written by benchmarks/uncertainty.py):

* compute, by how far the run is from the step times the GPU's kernel model was fitted on: a framework it was
  fitted on (leave-one-row-out), another framework on a fitted GPU (leave-one-table-out), a GPU with no fitted
  table (leave-one-GPU-out), kernels measured on this machine (the local ground truth);
* collectives: calibrated on this cluster (held-out message sizes), from the network prior (its own
  leave-one-cluster-out band, comm/network_priors.yaml), or uncalibrated (datasheet rates against measured logs);
* all-to-alls (expert parallelism), scored apart because they price worst.

One efficiency moves every kernel of its kind together, so each (component, level) is one random factor: the
exponential of the measured bias plus the measured spread of log(measured / predicted) times the next error of a
sample of that size (Student's t, predictive_draws), applied to that component's seconds
on the critical path; the factors are sampled and the step's critical path summed again. The interval at p % is
the central p % of those sums. Biases are kept: a model that is measured too fast gives an interval that reaches
further above the prediction than below it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

COMPONENT_ERRORS = Path(__file__).with_name("component_errors.yaml")
NOMINAL_LEVELS = (50, 80, 95)
"""The central coverages an interval is given at (percent); 80 is the one printed."""
PRINTED_LEVEL = 80
SAMPLES = 4000
"""Sampled critical paths per interval (fixed seed: the same step gives the same interval)."""
MAPE_TO_SPREAD = math.sqrt(math.pi / 2)
"""Standard deviation of a zero-mean normal error over its mean absolute value: a band given as a mean
|error| (the network prior's error_pct) as a spread."""
FEWEST_FOR_T = 3
"""Held-out errors below which an error's spread is taken as given (normal), not as a sample's estimate (t)."""
COMPUTE_LEVELS = ("measured", "fitted", "unseen_framework", "unseen_gpu")
"""The compute levels, nearest to what was fitted first: a level without a measured error takes the next wider
one's (never a narrower one's)."""
INTRA_NODE_KINDS = ("tp", "cp", "etp")
"""Group kinds whose collectives stay inside a node in the layouts trainsim builds (tensor, context and expert
tensor parallelism are placed innermost): priced by the calibrated links, never by the network prior."""


@dataclass(frozen=True)
class ComponentError:
    """One cost model's error on predictions it was not fitted on, at one level of extrapolation, as the log of
    measured over predicted: positive bias = the real time is longer than predicted."""

    component: str
    level: str
    bias: float
    spread: float
    count: int
    """held-out predictions it was measured on"""
    source: str


@functools.lru_cache(maxsize=4)
def component_errors(path: Path = COMPONENT_ERRORS) -> dict[tuple[str, str], ComponentError]:
    """(component, level) -> its measured error (component_errors.yaml)."""
    table = yaml.safe_load(Path(path).read_text())
    return {(component, level): ComponentError(component, level, float(entry["bias"]), float(entry["spread"]),
                                               int(entry["count"]), str(entry["source"]))
            for component, levels in table["components"].items() for level, entry in levels.items()}


@dataclass(frozen=True)
class StepInterval:
    """A predicted step time with its central intervals at NOMINAL_LEVELS, and the parts they were built from."""

    step_time_s: float
    bounds_s: dict[int, tuple[float, float]]
    """nominal level (%) -> (low, high) seconds"""
    parts: list[dict] = field(default_factory=list)
    """per (component, level): its seconds on the critical path, bias and spread (%), and their source"""
    samples_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, compare=False)
    """the sampled step times the intervals are quantiles of"""

    def probability_at_most(self, seconds: float) -> float:
        """The chance that the real step takes at most `seconds` (e.g. the step time that meets a deadline)."""
        return float(np.mean(self.samples_s <= seconds))

    def at(self, level: int = PRINTED_LEVEL) -> tuple[float, float]:
        return self.bounds_s[level]

    def ratios(self, level: int = PRINTED_LEVEL) -> tuple[float, float]:
        """(low, high) over the prediction: what any quantity proportional to the step time is multiplied by."""
        low, high = self.at(level)
        return low / self.step_time_s, high / self.step_time_s

    def describe(self, level: int = PRINTED_LEVEL) -> str:
        """'27.3 s (80 %: 25.1-29.8 s)'"""
        low, high = self.at(level)
        return f"{self.step_time_s:.3g} s ({level} %: {low:.3g}-{high:.3g} s)"

    def as_dict(self) -> dict:
        return {"step_time_s": self.step_time_s,
                "intervals_s": {str(level): list(bounds) for level, bounds in self.bounds_s.items()},
                "parts": self.parts}


def compute_level(fitted_frameworks: list[str], framework: str, backends: dict[str, int],
                  inside_fitted_range: bool) -> str:
    """How far the run's compute is from what its kernel model was fitted on: 'measured' (kernels timed on this
    machine), 'fitted' (a framework whose step times fitted this GPU, inside the fitted range), 'unseen_framework'
    (another framework, or outside that range), 'unseen_gpu' (no step time of this GPU was fitted)."""
    measured = sum(n for backend, n in backends.items() if backend != "analytical")
    if measured > backends.get("analytical", 0):
        return "measured"
    if not fitted_frameworks:
        return "unseen_gpu"
    if framework in fitted_frameworks and inside_fitted_range:
        return "fitted"
    return "unseen_framework"


def network_level(calibration: dict) -> tuple[str, float | None]:
    """The level of the collectives that leave a node, and the network prior's band where it prices them."""
    if not calibration.get("calibrated"):
        return "uncalibrated", None
    network = calibration.get("network", {})
    if network.get("measured"):
        return "calibrated", None
    if network.get("prior"):
        return "network_prior", float(network["uncertainty_pct"])
    return "uncalibrated", None


def critical_parts(summary: dict, compute: str, network: tuple[str, float | None]) -> dict[tuple[str, str], float]:
    """(component, level) -> seconds of the step's critical path it prices, scaled to sum to the step time."""
    by_category = summary["critical_path"]["by_category"]
    calibrated = "calibrated" if summary["inputs"]["calibration"].get("calibrated") else "uncalibrated"
    parts: dict[tuple[str, str], float] = {}
    for category, seconds in by_category.items():
        kind = category.removeprefix("comm.") if category.startswith("comm.") else None
        if kind is None:
            key = ("compute", compute)
        elif kind == "ep":
            key = ("alltoall", calibrated)
        elif kind in INTRA_NODE_KINDS:
            key = ("collectives", calibrated)
        else:
            key = ("collectives", network[0])
        parts[key] = parts.get(key, 0.0) + max(float(seconds), 0.0)
    total = sum(parts.values())
    step = float(summary["step_time_s"])
    if total <= 0:
        return {("compute", compute): step}
    return {key: seconds * step / total for key, seconds in parts.items()}


def part_error(key: tuple[str, str], network: tuple[str, float | None],
               errors: dict[tuple[str, str], ComponentError]) -> ComponentError:
    """The measured error of one part; the network prior's own band where it prices the part."""
    component, level = key
    if level == "network_prior" and network[1] is not None:
        return ComponentError(component, level, 0.0, network[1] / 100 * MAPE_TO_SPREAD, 0,
                              "the network prior's leave-one-cluster-out band (comm/network_priors.yaml)")
    if key in errors:
        return errors[key]
    wider = [errors[(component, w)] for w in COMPUTE_LEVELS[COMPUTE_LEVELS.index(level) + 1:]
             if (component, w) in errors] if component == "compute" and level in COMPUTE_LEVELS else []
    if not wider:
        raise KeyError(f"{COMPONENT_ERRORS}: no measured error for component {component!r} at level {level!r}; "
                       f"measured: {sorted(errors)} (python benchmarks/uncertainty.py --write)")
    stand_in = wider[0]
    return ComponentError(component, level, stand_in.bias, stand_in.spread, stand_in.count,
                          f"level {level} not measured; {stand_in.level}'s error stands in: {stand_in.source}")


def predictive_draws(error: ComponentError, samples: int, rng: np.random.Generator) -> np.ndarray:
    """Standardised draws of the next error of a model whose bias and spread were estimated from error.count
    held-out predictions: Student's t with count - 1 degrees of freedom times sqrt(1 + 1 / count), the
    prediction interval of a new draw when mean and deviation are both estimated (a few errors cannot pin the
    spread down; many give the normal). A spread not estimated from a sample (count below FEWEST_FOR_T) draws normal."""
    if error.count < FEWEST_FOR_T:
        return rng.standard_normal(samples)
    return rng.standard_t(error.count - 1, samples) * math.sqrt(1 + 1 / error.count)


def sample_steps(parts: dict[tuple[str, str], float], errors: list[ComponentError], samples: int = SAMPLES,
                 seed: int = 0) -> np.ndarray:
    """Step times with each part multiplied by its own log factor (one draw per part and sample)."""
    seconds = np.array(list(parts.values()))
    bias = np.array([e.bias for e in errors])
    spread = np.array([e.spread for e in errors])
    rng = np.random.default_rng(seed)
    draws = np.column_stack([predictive_draws(e, samples, rng) for e in errors]) if errors else np.zeros((samples, 0))
    return np.exp(bias + spread * draws) @ seconds


def central_intervals(steps: np.ndarray, levels: tuple[int, ...] = NOMINAL_LEVELS) -> dict[int, tuple[float, float]]:
    return {level: (float(np.quantile(steps, (1 - level / 100) / 2)), float(np.quantile(steps, (1 + level / 100) / 2)))
            for level in levels}


def sample_interval(step_time_s: float, parts: dict[tuple[str, str], float], errors: list[ComponentError],
                    levels: tuple[int, ...] = NOMINAL_LEVELS, samples: int = SAMPLES, seed: int = 0
                    ) -> dict[int, tuple[float, float]]:
    """The central intervals of the step when each part is multiplied by its own factor (sample_steps)."""
    return central_intervals(sample_steps(parts, errors, samples, seed), levels)


def probability_best(chosen: float, others: list[float], spread: float, samples: int = SAMPLES,
                     seed: int = 0) -> float:
    """The chance that `chosen` is really the smallest of it and `others` (estimates of one quantity, e.g. step
    times of layouts on one GPU), when each moves by its own log-normal error of `spread`: the error they share
    cancels, what is left is the spread between runs of one table (component 'ranking')."""
    if not others:
        return 1.0
    values = np.log(np.array([chosen, *others]))
    draws = values + spread * np.random.default_rng(seed).standard_normal((samples, len(values)))
    return float(np.mean(np.argmin(draws, axis=1) == 0))


def upper_ratio(error: ComponentError, confidence: float) -> float:
    """The factor over a prediction that the real value stays under with `confidence` (one-sided)."""
    if error.count < FEWEST_FOR_T:
        from statistics import NormalDist

        return math.exp(error.bias + NormalDist().inv_cdf(confidence) * error.spread)
    from scipy.stats import t

    quantile = t.ppf(confidence, error.count - 1) * math.sqrt(1 + 1 / error.count)  # as predictive_draws
    return math.exp(error.bias + float(quantile) * error.spread)


def step_interval(summary: dict, fitted_frameworks: list[str], framework: str,
                  errors: dict[tuple[str, str], ComponentError] | None = None) -> StepInterval:
    """The interval of a composed step (its summary.json) run with `framework` on hardware whose kernel model was
    fitted to the step times of `fitted_frameworks` (hardware.kernel_model.fitted_frameworks)."""
    errors = component_errors() if errors is None else errors
    kernels = summary["inputs"].get("kernels", {})
    compute = compute_level(fitted_frameworks, framework, summary.get("compute_backends", {}),
                            kernels.get("inside_fitted_range") is not False)
    network = network_level(summary["inputs"]["calibration"])
    parts = critical_parts(summary, compute, network)
    measured = [part_error(key, network, errors) for key in parts]
    step = float(summary["step_time_s"])
    steps = sample_steps(parts, measured)
    return StepInterval(step, central_intervals(steps), [
        {"component": e.component, "level": e.level, "seconds": seconds, "bias_pct": 100 * math.expm1(e.bias),
         "spread_pct": 100 * e.spread, "source": e.source} for e, seconds in zip(measured, parts.values())], steps)
