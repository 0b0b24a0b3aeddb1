"""The per-GPU kernel-model fit (validation/kernel_fit.py) on synthetic rows whose step time is a known function
of the efficiencies: it recovers them from the data-free start, and no leave-one-row-out fold sees its row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainsim.validation.fitting import SENSITIVITY_STEP
from trainsim.validation.kernel_fit import (
    FITTED_PER_GPU,
    FitRow,
    StepTimes,
    alternate_groups,
    data_free_params,
    fit_gauss_newton,
    leave_one_row_out,
)

TRUTH = {"matmul_efficiency": 0.66, "fp8_matmul_efficiency": 0.69, "memory_efficiency": 0.79}


class SyntheticTimes(StepTimes):
    """Rows whose step time is fixed seconds plus, per parameter, kernel work over its efficiency, with the
    GEMMs partly hidden behind the fixed part (a nonlinear overlap, as a composed timeline has)."""

    def __init__(self, work: np.ndarray, fixed: np.ndarray, hw, workers: int = 2):
        super().__init__([FitRow(Path(), None, hw, None, None)] * len(work), data_free_params(hw), workers)
        self.work, self.fixed = work, fixed

    def compose_one(self, i, params, moved=None):
        p = np.array([params[n] * (1 / (1 + SENSITIVITY_STEP) if n == moved else 1) for n in FITTED_PER_GPU])
        kernels = self.work[i] / p
        return float(self.fixed[i] + kernels[2] + np.hypot(kernels[0] + kernels[1], 0.3 * self.fixed[i]))

    def depends(self, i, name):
        return bool(self.work[i, FITTED_PER_GPU.index(name)] > 0)


@pytest.fixture
def times():
    from trainsim.config import compose_run

    hw = compose_run(["hardware=h100-sxm-dgx"]).hardware
    rng = np.random.default_rng(0)
    work = rng.uniform(0.5, 2.0, (12, 3)) * (rng.uniform(size=(12, 3)) > [0, 0.5, 0])  # FP8 on about half
    return SyntheticTimes(work, rng.uniform(0.1, 1.0, 12), hw)


def measured(times, params=TRUTH):
    return np.array([times.seconds(i, params) for i in range(len(times.rows))])


def test_gauss_newton_recovers_the_efficiencies_from_the_data_free_start(times):
    fit = fit_gauss_newton(times, range(len(times.rows)), measured(times))
    assert fit.moved < 1e-3
    assert fit.params == pytest.approx(TRUTH, rel=2e-3)


def test_forked_workers_compose_what_one_process_does(times):
    one = SyntheticTimes(times.work, times.fixed, times.rows[0].hw, workers=1)
    groups = alternate_groups(["a"] * 12)
    for fit in (times, one):
        leave_one_row_out(fit, measured(fit), groups)
    assert times.composed == one.composed and len(one.composed) > 24


def test_a_fold_never_sees_its_row_and_sees_every_other(times):
    groups = alternate_groups(["a"] * 8 + ["b"] * 4)
    assert list(groups) == [0, 1] * 6
    clean = measured(times) * np.random.default_rng(1).uniform(0.95, 1.05, 12)  # not exactly fittable
    held_out = 4
    fold = leave_one_row_out(times, clean, groups, only=[held_out])
    assert fold.folds[0] == pytest.approx(TRUTH, rel=0.05)
    poisoned = clean.copy()
    poisoned[held_out] *= 3
    same = leave_one_row_out(times, poisoned, groups, only=[held_out])
    assert same.folds == fold.folds and same.predicted_s[0] == fold.predicted_s[0]
    for training in (6, 5):  # the row's own group, then the other (which moves the linearisation point)
        trained = clean.copy()
        trained[training] *= 3
        moved = leave_one_row_out(times, trained, groups, only=[held_out])
        assert max(abs(moved.folds[0][n] / fold.folds[0][n] - 1) for n in FITTED_PER_GPU) > 1e-3
        assert moved.predicted_s[0] != fold.predicted_s[0]


GPU_CONFIGS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf/hardware").glob("*.yaml")
                     if p.stem not in ("local-cpu", "a100-80g-vtrain"))


@pytest.mark.parametrize("hardware", GPU_CONFIGS)
def test_every_gpu_config_starts_its_fits_at_a_measured_matmul_ceiling(hardware):
    """A GPU without its own row would start at its datasheet peak (efficiency 1), and its fitted-over-start
    ratios would mislead the GPUs that borrow them (leave-one-GPU-out)."""
    from trainsim.config import compose_run

    hw = compose_run([f"hardware={hardware}"]).hardware
    start = data_free_params(hw)
    assert 0.6 < start["matmul_efficiency"] < 0.9 and 0.6 < start["fp8_matmul_efficiency"] < 0.9, hw.device_name
