"""The interval of a composed step: built from the measured component errors, wider where the run is further from
what was fitted, shifted by a measured bias, and as often right as it claims on errors drawn from its own model."""

import math

import numpy as np
import pytest

from trainsim.uncertainty.interval import (
    ComponentError,
    component_errors,
    compute_level,
    network_level,
    sample_interval,
    step_interval,
)

ERRORS = {("compute", "fitted"): ComponentError("compute", "fitted", 0.0, 0.05, 30, "test"),
          ("compute", "unseen_framework"): ComponentError("compute", "unseen_framework", 0.05, 0.10, 30, "test"),
          ("compute", "unseen_gpu"): ComponentError("compute", "unseen_gpu", 0.10, 0.20, 30, "test"),
          ("compute", "measured"): ComponentError("compute", "measured", 0.0, 0.04, 5, "test"),
          ("collectives", "calibrated"): ComponentError("collectives", "calibrated", 0.0, 0.07, 0, "test"),
          ("collectives", "uncalibrated"): ComponentError("collectives", "uncalibrated", 0.0, 0.2, 0, "test"),
          ("alltoall", "calibrated"): ComponentError("alltoall", "calibrated", 0.0, 0.35, 0, "test"),
          ("alltoall", "uncalibrated"): ComponentError("alltoall", "uncalibrated", 0.0, 0.6, 0, "test")}
FITTED = ["megatron-core"]


def summary(by_category: dict[str, float], calibrated: bool = True, network: dict | None = None,
            backends: dict | None = None, inside: bool = True) -> dict:
    return {"step_time_s": sum(by_category.values()), "critical_path": {"by_category": by_category},
            "compute_backends": backends or {"analytical": 100},
            "inputs": {"calibration": {"calibrated": calibrated, "network": network or {"measured": True}},
                       "kernels": {"inside_fitted_range": inside}}}


def width(interval, level=80) -> float:
    low, high = interval.ratios(level)
    return high - low


def test_levels_follow_what_the_kernel_model_was_fitted_on():
    assert compute_level(FITTED, "megatron-core", {"analytical": 9}, True) == "fitted"
    assert compute_level(FITTED, "megatron-core", {"analytical": 9}, False) == "unseen_framework"
    assert compute_level(FITTED, "torchtitan", {"analytical": 9}, True) == "unseen_framework"
    assert compute_level([], "megatron-core", {"analytical": 9}, True) == "unseen_gpu"
    assert compute_level([], "pytorch", {"cpu": 9, "analytical": 1}, True) == "measured"
    assert network_level({"calibrated": False}) == ("uncalibrated", None)
    assert network_level({"calibrated": True, "network": {"prior": "p", "uncertainty_pct": 13.5}}) == \
        ("network_prior", 13.5)


def test_interval_widens_away_from_the_fitted_data():
    step = {"compute": 10.0}
    fitted = step_interval(summary(step), FITTED, "megatron-core", ERRORS)
    framework = step_interval(summary(step), FITTED, "torchtitan", ERRORS)
    gpu = step_interval(summary(step), [], "torchtitan", ERRORS)
    assert width(fitted) < width(framework) < width(gpu)
    for interval in (fitted, framework, gpu):
        low, high = interval.at(80)
        assert interval.at(95)[0] < low < interval.at(50)[0] <= interval.at(50)[1] < high < interval.at(95)[1]
    # a measured bias (the real step slower) moves the interval up: most of it lies above the prediction
    assert gpu.at(80)[1] - 10.0 > 10.0 - gpu.at(80)[0]
    assert fitted.at(80)[0] < 10.0 < fitted.at(80)[1]


def test_a_lognormal_part_alone_gives_its_analytic_quantiles():
    error = ComponentError("compute", "fitted", 0.02, 0.1, 1, "test")
    low, high = sample_interval(5.0, {("compute", "fitted"): 5.0}, [error], levels=(80,), samples=200_000)[80]
    z = 1.2815515655446004  # the standard normal's 90th percentile
    assert low == pytest.approx(5.0 * math.exp(0.02 - z * 0.1), rel=0.01)
    assert high == pytest.approx(5.0 * math.exp(0.02 + z * 0.1), rel=0.01)


def test_an_error_measured_on_few_predictions_gives_the_prediction_interval_of_a_new_one():
    """Bias and spread estimated from n held-out errors: the next error falls inside mean +- t(n-1) s sqrt(1 + 1/n)
    as often as claimed, wider than the normal's quantile for few errors, the same for many."""
    from scipy.stats import t

    few, many = (ComponentError("compute", "fitted", 0.0, 0.1, n, "test") for n in (4, 400))
    intervals = {n: sample_interval(5.0, {("compute", "fitted"): 5.0}, [e], levels=(80,), samples=200_000)[80]
                 for n, e in ((4, few), (400, many))}
    for n, (low, high) in intervals.items():
        half = t.ppf(0.9, n - 1) * math.sqrt(1 + 1 / n) * 0.1
        assert (low, high) == pytest.approx((5.0 * math.exp(-half), 5.0 * math.exp(half)), rel=0.01)
    assert math.log(intervals[4][1] / 5.0) > 1.3 * math.log(intervals[400][1] / 5.0)  # t(3) reaches much further
    assert intervals[400][1] == pytest.approx(5.0 * math.exp(1.2815515655446004 * 0.1), rel=0.01)


def test_kernels_of_one_kind_move_together():
    """Splitting the compute into parts does not narrow its interval: one efficiency moves all its kernels."""
    one = step_interval(summary({"compute": 10.0}), FITTED, "megatron-core", ERRORS)
    two = step_interval(summary({"compute": 6.0, "host": 4.0}), FITTED, "megatron-core", ERRORS)
    assert width(two) == pytest.approx(width(one), rel=1e-9)
    # independent components do narrow it relative to their sum's worst case
    mixed = step_interval(summary({"compute": 5.0, "comm.dp": 5.0}, calibrated=False), FITTED, "megatron-core", ERRORS)
    assert width(mixed) < 0.5 * 2 * 1.2816 * (0.05 + 0.2) * 1.05


def test_collectives_are_priced_by_their_calibration_and_the_network_prior_band():
    network = {"prior": "infiniband", "uncertainty_pct": 30.0}
    step = summary({"compute": 1.0, "comm.tp": 1.0, "comm.dp": 8.0}, network=network)
    interval = step_interval(step, FITTED, "megatron-core", ERRORS)
    levels = {(p["component"], p["level"]): p for p in interval.parts}
    assert set(levels) == {("compute", "fitted"), ("collectives", "calibrated"), ("collectives", "network_prior")}
    assert levels[("collectives", "network_prior")]["spread_pct"] == pytest.approx(30.0 * math.sqrt(math.pi / 2))
    assert levels[("collectives", "network_prior")]["seconds"] == pytest.approx(8.0)
    ep = step_interval(summary({"compute": 5.0, "comm.ep": 5.0}), FITTED, "megatron-core", ERRORS)
    assert ("alltoall", "calibrated") in {(p["component"], p["level"]) for p in ep.parts}


def test_a_level_without_a_measured_error_takes_a_wider_one_or_is_named():
    errors = {k: v for k, v in ERRORS.items() if k != ("compute", "unseen_framework")}
    parts = step_interval(summary({"compute": 1.0}), FITTED, "torchtitan", errors).parts
    assert parts[0]["spread_pct"] == pytest.approx(20.0) and "unseen_gpu's error stands in" in parts[0]["source"]
    errors = {k: v for k, v in ERRORS.items() if k != ("compute", "unseen_gpu")}
    with pytest.raises(KeyError, match="unseen_gpu"):
        step_interval(summary({"compute": 1.0}), [], "pytorch", errors)


def test_intervals_cover_as_often_as_they_claim_on_errors_from_their_model():
    rng = np.random.default_rng(7)
    error = ERRORS[("compute", "unseen_framework")]
    truth = 10.0 * np.exp(error.bias + error.spread * rng.standard_normal(2000))
    bounds = step_interval(summary({"compute": 10.0}), FITTED, "torchtitan", ERRORS).bounds_s
    for level, (low, high) in bounds.items():
        assert 100 * np.mean((truth >= low) & (truth <= high)) == pytest.approx(level, abs=3)


def test_the_shipped_errors_cover_every_level_a_prediction_can_take():
    shipped = component_errors()
    for component, levels in (("compute", ("fitted", "unseen_framework", "unseen_gpu", "measured")),
                              ("collectives", ("calibrated", "uncalibrated")),
                              ("alltoall", ("calibrated", "uncalibrated"))):
        for level in levels:
            entry = shipped[(component, level)]
            assert 0 < entry.spread < 1, (component, level)
            assert entry.source


def test_the_chance_of_being_fastest_falls_as_the_alternatives_come_closer():
    from trainsim.uncertainty.interval import probability_best, upper_ratio

    assert probability_best(10.0, [], 0.05) == 1.0
    far, near = probability_best(10.0, [13.0, 14.0], 0.05), probability_best(10.0, [10.2, 14.0], 0.05)
    assert far > 0.99 and 0.5 < near < 0.75
    assert probability_best(10.0, [10.0], 0.05) == pytest.approx(0.5, abs=0.03)  # a tie is a coin toss
    error = ComponentError("compute", "fitted", 0.0, 0.1, 1, "test")
    assert upper_ratio(error, 0.5) == pytest.approx(1.0)
    assert upper_ratio(error, 0.9) == pytest.approx(math.exp(1.2815515655446004 * 0.1))


def test_the_chance_of_meeting_a_step_time_reads_the_samples():
    interval = step_interval(summary({"compute": 10.0}), FITTED, "megatron-core", ERRORS)
    low, high = interval.at(80)
    assert interval.probability_at_most(high) == pytest.approx(0.9, abs=0.01)
    assert interval.probability_at_most(low) == pytest.approx(0.1, abs=0.01)
