"""The kernel model's per-GPU efficiencies fitted to published step times, with no fold seeing its held-out row.

Each row's step time is a composed timeline, nonlinear in the efficiencies (overlap, the critical path), so a
fit linearises it around a point and refits there (Gauss-Newton). Where it starts matters: a point fitted on
every row leaks the held-out row into each fold. So every fit starts from a point fitted to no step time
(`data_free_params`) and moves only by fits on its own rows:
  * the all-rows fit (what conf/hardware carries): Gauss-Newton on every row from the data-free point;
  * leave-one-row-out: the rows are split into two groups (alternate rows of each table, by position, not
    by value); each group is fitted alone by Gauss-Newton, and a fold holding out a row of one group is
    linearised where the other group's fit converged (a point fitted on a subset of the fold's own training
    rows) and fitted once there. Two converged points per GPU serve every fold, instead of one per fold.
Each row's step time is composed once per point and shared by every fit that linearises there; the step times a
linearisation needs are composed together, on forked worker processes (one per core), since they are independent.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from trainsim.config.data_path import DATA_DIR
from trainsim.config.devices import device_type_of
from trainsim.config.schema import HardwareConfig, ParallelismConfig
from trainsim.validation.fitting import SENSITIVITY_STEP, with_kernel_params
from trainsim.validation.traces import analytical_step, trace_tables

FITTED_PER_GPU = ("matmul_efficiency", "fp8_matmul_efficiency", "memory_efficiency")
"""The kernel model's parameters fitted per GPU across the rows of its tables (hardware.kernel_model fields):
what large bf16 and FP8 GEMMs and streaming kernels reach on that GPU. A parameter no row depends on (FP8 on a
GPU without FP8 rows) stays at its data-free start. Everything else is physics or a datasheet/kernel-benchmark
number."""
CEILING_DTYPE = {"matmul_efficiency": "bf16", "fp8_matmul_efficiency": "float8_e4m3fn"}
"""FITTED_PER_GPU GEMM parameter -> the mamf dtype whose best measured throughput bounds it"""
MATMUL_CEILING = DATA_DIR / "kernels/matmul_max-achievable-tflops_mlengineering.csv"
CEILING_ROWS = {
    "A100": ("NVIDIA A100 SXM",), "H100": ("NVIDIA H100 SXM",), "H800": ("NVIDIA H100 SXM",),
    "H200": ("NVIDIA H200 SXM", "NVIDIA H100 SXM"), "B200": ("NVIDIA B200 SXM",), "B300": ("NVIDIA B300 SXM",),
    "GB200": ("NVIDIA GB200 SXM",), "GB300": ("NVIDIA GB200 SXM",),
}
"""GPU family (config/devices.py) -> the accelerator rows of the best measured matmul throughput (mamf-finder),
the GPU's own first, then a part of the same silicon where the table has no row of that dtype: the H800 is H100
silicon (and so is the 500 W Grand Teton H100, whose config peaks are already its power-limited clock's, so the
measured fraction of peak carries), the H200's bf16 is the H100's (the table notes "H200 is the same"), and the
GB300 takes the GB200's (the same Grace-Blackwell package and dense peaks; the table has no GB300 row)."""
CONVERGED = 1e-3
"""Gauss-Newton stops when no parameter moves by more than this fraction."""
MOST_ITERATIONS = 4


@functools.cache
def matmul_ceilings() -> pd.DataFrame:
    """The mamf-finder table (read once: every fit step bounds its efficiencies by it)."""
    return pd.read_csv(MATMUL_CEILING, comment="#")


def matmul_ceiling(hw: HardwareConfig, dtype: str = "bf16") -> float:
    """The highest matmul_efficiency a fit may reach: the best torch.mm throughput measured on this GPU over
    its datasheet peak (no GEMM of a training step beats a brute-force search for the fastest shape); 1
    where the GPU has no row."""
    table = matmul_ceilings()
    for accelerator in CEILING_ROWS.get(device_type_of(hw.device_kind, hw.device_name), ()):
        row = table[(table["accelerator"] == accelerator) & (table["dtype"] == dtype)]
        if len(row):
            return float(row["mamf_tflops"].iloc[0] / row["theory_tflops"].iloc[0])
    return 1.0


CARRIED_TO = {"a100-80g-selene": ("a100-80g-dgx",), "h100-sxm-dgx": ("h200-sxm-dgx", "h800-dgx", "h100-grand-teton")}
"""fitted hardware -> the configs of the same GPU (or the same silicon without published tables of its own) that
carry its fit unchanged: fit_kernel_model --write writes them too, tests/validation/test_scale_figures.py checks
they agree, and validation/generalisation.py predicts their held-out rows with it, as a user's run gets it"""


def data_free_params(hw: HardwareConfig) -> dict[str, float]:
    """Where every fit starts, fitted to no step time: each GEMM dtype at its `matmul_ceiling` (the best
    measured matmul over peak, data/kernels; FP8 at the bf16 one where the GPU has no FP8 row) and streaming
    kernels at the datasheet bandwidth (memory_efficiency 1)."""
    bf16 = matmul_ceiling(hw, "bf16")
    fp8 = matmul_ceiling(hw, CEILING_DTYPE["fp8_matmul_efficiency"]) if "fp8" in hw.peak_flops_per_s else bf16
    return {"matmul_efficiency": bf16, "fp8_matmul_efficiency": fp8, "memory_efficiency": 1.0}


def kernel_params(hw: HardwareConfig) -> np.ndarray:
    """FITTED_PER_GPU's values in effect on `hw` (an unset FP8 GEMM efficiency is the bf16 one)."""
    from trainsim.profile.analytical import matmul_efficiency

    km = hw.kernel_model
    return np.array([matmul_efficiency(km, "fp8") if n == "fp8_matmul_efficiency" else getattr(km, n)
                     for n in FITTED_PER_GPU])


def fit_ratios(base: np.ndarray, slopes: np.ndarray, measured: np.ndarray, hw: HardwareConfig) -> dict[str, float]:
    """Least squares on log step time of rows linearised at `hw`'s FITTED_PER_GPU values, over the parameters
    some row depends on; efficiencies stay in [0.05, ceiling] (`matmul_ceiling` of the GEMMs' dtype, 1 for
    memory). `slopes` are by each parameter's inverse ratio r = p0 / p (kernel time is proportional to
    1/efficiency where that parameter binds)."""
    from scipy.optimize import least_squares

    active = np.abs(slopes).sum(axis=0) > 0
    p0 = kernel_params(hw)[active]
    ceiling = np.array([matmul_ceiling(hw, CEILING_DTYPE[n]) if n in CEILING_DTYPE else 1.0
                        for n in FITTED_PER_GPU])[active]
    lower, upper = p0 / ceiling, p0 / 0.05  # ratio r = p0 / p: p <= ceiling <=> r >= p0 / ceiling
    slopes = slopes[:, active]

    def residuals(r):
        return np.log(np.maximum(base + slopes @ (r - 1), 1e-9)) - np.log(measured)

    fit = least_squares(residuals, np.clip(np.ones(len(p0)), lower, upper), bounds=(lower, upper))
    return {name: float(p / r) for name, p, r in zip(np.array(FITTED_PER_GPU)[active], p0, fit.x)}


@dataclass(frozen=True)
class FitRow:
    """One traced row as the fits compose it: its trace, layout, hardware (with the table's kernels),
    collective model and the overlap slowdown `trainsim compose` applies on that hardware."""

    directory: Path
    par: ParallelismConfig
    hw: HardwareConfig
    comm: object
    slowdown: object


_forked_times: StepTimes | None = None
"""The StepTimes whose `compose` forks workers: they inherit it rather than receive its rows and traces."""


def _compose_forked(job: tuple[tuple, tuple]) -> tuple[tuple, float]:
    key, (i, params, moved) = job
    return key, _forked_times.compose_one(i, params, moved)


def point_key(params: dict[str, float]) -> tuple:
    return tuple(round(float(params[n]), 12) for n in FITTED_PER_GPU)


@dataclass
class StepTimes:
    """The rows of one GPU and their step times, composed once per (row, point), and their slopes.

    The slopes are measured once, at `start`, and carried to other points with the kernel times they stand
    for: a slope by a parameter's inverse ratio is the time its kernels add to the step, and kernel time is
    proportional to 1/efficiency, so at p it is the start's times start/p (the simplified Gauss-Newton: the
    residuals are composed exactly at every point, the Jacobian is the start's, rescaled). Moving from the
    start changes which kernels are exposed only where the critical path changes."""

    rows: Sequence[FitRow]
    start: dict[str, float]
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    """processes composing the step times of one call to `compose`"""
    composed: dict = field(default_factory=dict)
    """(row index, point_key, moved parameter or None) -> step seconds"""
    start_slopes: dict = field(default_factory=dict)
    """row index -> its slopes at start"""

    def compose_one(self, i: int, params: dict[str, float], moved: str | None) -> float:
        """Row i's step time at `params`, with `moved`'s kernels SENSITIVITY_STEP slower where given (uncached)."""
        row = self.rows[i]
        hw = with_kernel_params(row.hw, params)
        if moved is not None:
            hw = with_kernel_params(hw, {moved: params[moved] / (1 + SENSITIVITY_STEP)})
        return analytical_step(row.directory, row.par, hw, row.comm, row.slowdown).step_time_s

    def compose(self, wanted: Iterable[tuple[int, dict[str, float], str | None]]) -> None:
        """Compose the (row index, params, moved) step times not composed yet: on `workers` processes forked
        from this one where several are missing (each inherits the traces this process read, `depends` reads
        them, and returns a float); in this process where it is itself a pool's worker (which cannot fork)."""
        missing = {}
        for i, params, moved in wanted:
            key = (i, point_key(params), moved)
            if key not in self.composed:
                missing[key] = (i, params, moved)
        workers = 1 if multiprocessing.current_process().daemon else min(self.workers, len(missing))
        if workers <= 1:
            for key, job in missing.items():
                self.composed[key] = self.compose_one(*job)
            return
        global _forked_times
        _forked_times = self
        try:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                self.composed.update(pool.imap_unordered(_compose_forked, missing.items()))
        finally:
            _forked_times = None

    def seconds(self, i: int, params: dict[str, float], moved: str | None = None) -> float:
        """Row i's step time at `params`, with `moved`'s kernels SENSITIVITY_STEP slower where given."""
        self.compose([(i, params, moved)])
        return self.composed[i, point_key(params), moved]

    def seconds_of(self, indices: Iterable[int], params: dict[str, float]) -> np.ndarray:
        """The step times of rows `indices` at `params`, composed together."""
        indices = list(indices)
        self.compose((i, params, None) for i in indices)
        return np.array([self.composed[i, point_key(params), None] for i in indices])

    def depends(self, i: int, name: str) -> bool:
        """Whether any kernel of row i changes with parameter `name` (no compose where none does)."""
        from trainsim.profile.analytical import predict_rows

        row = self.rows[i]
        ops = trace_tables(row.directory)[2]
        hw = with_kernel_params(row.hw, self.start)
        moved = with_kernel_params(hw, {name: self.start[name] / (1 + SENSITIVITY_STEP)})
        return not np.array_equal(np.asarray(predict_rows(ops, hw)), np.asarray(predict_rows(ops, moved)))

    def slopes(self, i: int) -> np.ndarray:
        """Row i's step-time slopes at start by each FITTED_PER_GPU parameter's inverse ratio, by finite
        differences (zero where no kernel of the row depends on the parameter)."""
        return self.slopes_of([i])[0]

    def slopes_of(self, indices: Iterable[int]) -> np.ndarray:
        """slopes() of rows `indices`, their finite differences composed together."""
        indices = list(indices)
        todo = [i for i in dict.fromkeys(indices) if i not in self.start_slopes]
        moved = {(i, name) for i in todo for name in FITTED_PER_GPU if self.depends(i, name)}
        self.compose([(i, self.start, None) for i in todo] + [(i, self.start, name) for i, name in moved])
        start = point_key(self.start)
        for i in todo:
            base = self.composed[i, start, None]
            self.start_slopes[i] = np.array([
                (self.composed[i, start, name] - base) / SENSITIVITY_STEP if (i, name) in moved else 0.0
                for name in FITTED_PER_GPU])
        return np.array([self.start_slopes[i] for i in indices]).reshape(len(indices), len(FITTED_PER_GPU))

    def linearise(self, params: dict[str, float], indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The rows' step times at `params` and their slopes there (the start's, rescaled)."""
        slopes = self.slopes_of(indices)  # first: `depends` reads the traces the workers of seconds_of inherit
        scale = np.array([self.start[n] / params[n] for n in FITTED_PER_GPU])
        return self.seconds_of(indices, params), slopes * scale

    def fit_step(self, point: dict[str, float], indices: Sequence[int], measured: np.ndarray) -> dict[str, float]:
        """One Gauss-Newton step: the rows `indices` linearised at `point` and fitted to their `measured`."""
        base, slopes = self.linearise(point, indices)
        return {**point, **fit_ratios(base, slopes, measured[list(indices)],
                                      with_kernel_params(self.rows[0].hw, point))}


@dataclass
class GaussNewton:
    params: dict[str, float]
    """the fit"""
    linearised_at: dict[str, float]
    """the point of its last linearisation (within CONVERGED of params when converged)"""
    iterations: int
    moved: float
    """the largest relative move of a parameter in the last step"""


def fit_gauss_newton(times: StepTimes, indices: Sequence[int], measured: np.ndarray) -> GaussNewton:
    """FITTED_PER_GPU fitted to the rows `indices` alone, from times.start: linearised, fitted, linearised
    again at the fit, until no parameter moves by CONVERGED or MOST_ITERATIONS steps."""
    point, moved = dict(times.start), np.inf
    for iteration in range(1, MOST_ITERATIONS + 1):
        fit = times.fit_step(point, indices, measured)
        moved = max(abs(fit[n] / point[n] - 1) for n in FITTED_PER_GPU)
        if moved < CONVERGED or iteration == MOST_ITERATIONS:
            return GaussNewton(fit, point, iteration, moved)
        point = fit
    raise AssertionError("unreachable")


def alternate_groups(tables: Sequence[str]) -> np.ndarray:
    """Group 0 or 1 per row: alternate rows of each table (by position), so each group spans every table."""
    groups, seen = [], {}
    for table in tables:
        groups.append(seen.get(table, 0) % 2)
        seen[table] = seen.get(table, 0) + 1
    return np.array(groups)


@dataclass
class LeaveOneRowOut:
    folds: list[dict[str, float]]
    """per row: FITTED_PER_GPU fitted without it"""
    predicted_s: np.ndarray
    """per row: its step time composed with its fold's fit"""
    group_fits: list[GaussNewton | None]
    """the two groups' own fits, where the other group's folds are linearised (None where no fold needed it)"""


def leave_one_row_out(times: StepTimes, measured: np.ndarray, groups: np.ndarray,
                      only: Sequence[int] | None = None) -> LeaveOneRowOut:
    """Each row's fold (the rows `only`, default all): the other rows fitted, linearised where the other
    group's own fit converged (a point that depends only on rows of the fold), then the row composed with that
    fit."""
    only = range(len(times.rows)) if only is None else only
    needed = {1 - groups[i] for i in only}
    group_fits = [fit_gauss_newton(times, np.flatnonzero(groups == g), measured) if g in needed else None
                  for g in (0, 1)]
    folds = [times.fit_step(group_fits[1 - groups[i]].linearised_at, [k for k in range(len(times.rows)) if k != i],
                            measured) for i in only]
    times.compose((i, fold, None) for i, fold in zip(only, folds))
    return LeaveOneRowOut(folds, np.array([times.seconds(i, fold) for i, fold in zip(only, folds)]), group_fits)
