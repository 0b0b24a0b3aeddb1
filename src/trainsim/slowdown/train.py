"""Stage 5: train the XGBoost slowdown regressor and measure it against the constant-factor baseline.

As Echo's training_testing/train.py: an 80/20 split (seeded by random_state), 5-fold cross-validation
on the 80 % part, the final model fitted on the 80 % part and tested on the 20 % hold-out; objective
reg:squarederror, max_depth 12, random_state 42 (all in `hardware.slowdown.model`). XGBRegressor is a
thin scikit-learn wrapper around `xgboost.train`; the native call with the same parameters
(n_estimators -> rounds, learning_rate -> eta, random_state -> seed) trains the same model without
adding scikit-learn to the project.

Only instances with status 'ok' (overlap fraction > 0) are targets; zero-overlap rows are counted.
Metrics are those of Echo's predict.py, on overlapped kernels: the predicted overlapped duration
t = (1 - r) * solo + r * solo * (1 + s) (method.md 1.3) against the measured one: share within
5 / 10 / 15 %, RMSE, and the signed error of the summed duration; the same for the baseline, one mean
slowdown per device type fitted on the training part (the constant factor Proteus applies).

Then the figure `hardware.slowdown.use=auto` decides on (`held_out_group_scores`): the same model settings
cross-validated over all overlapped kernels folded by kernel group (`grouped_cv`, nested tuning, the composer's
features), against predicting no slowdown for the same kernels, as benchmarks/slowdown_accuracy.py measures.

With `duration_weighting`, each kernel's weight is (r * solo / overlapped)^p (p = 2 for squared,
1 for absolute error): the loss on s then equals the loss on the relative overlapped duration, which
is what the metrics measure, and kernels whose slowdown is ill-determined (tiny r) stop dominating.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from trainsim.config.schema import SlowdownModelConfig
from trainsim.errors import ConfigError
from trainsim.slowdown.dataset import STATUS_OK, status_counts
from trainsim.slowdown.features import CATEGORICAL, FEATURES, dataset_features

if TYPE_CHECKING:  # imported where a model is trained or run: config validation and tracing need no XGBoost
    import xgboost as xgb

# set: a format version
SCHEMA_VERSION = 2  # 2: features computable at compose (no Nsight metrics, device numbers for device_type)
# set: the error bands reported
WITHIN = (5, 10, 15)
HELD_OUT_GROUPS = "held_out_groups"
"""metrics.json key of held_out_group_scores: the model against no slowdown on unseen kernel groups."""
ABSOLUTE_OBJECTIVES = ("reg:absoluteerror", "reg:quantileerror", "reg:pseudohubererror")


@dataclass
class TrainResult:
    booster: xgb.Booster
    schema: dict
    """Feature names, categories, version, parameters and baseline: what the predictor needs."""
    metrics: dict
    importances: pd.DataFrame
    predictions: pd.DataFrame
    """Every target kernel: split ('cv' fold or 'holdout'), measured and predicted slowdown and duration."""


def model_features(cfg: SlowdownModelConfig) -> list[str]:
    unknown = [f for f in cfg.features if f not in FEATURES]
    if unknown:
        raise ConfigError(f"hardware.slowdown.model.features has unknown name(s) {unknown}; accepted: {list(FEATURES)}")
    return list(cfg.features) or list(FEATURES)


def xgb_params(cfg: SlowdownModelConfig) -> dict:
    params = {"objective": cfg.objective, "max_depth": cfg.max_depth, "seed": cfg.random_state,
              "eta": cfg.learning_rate, "min_child_weight": cfg.min_child_weight, "tree_method": "hist"}
    return params | ({"nthread": cfg.nthread} if cfg.nthread > 0 else {})


TUNED = ("learning_rate", "n_estimators", "max_depth", "min_child_weight")


def candidates(cfg: SlowdownModelConfig) -> list[SlowdownModelConfig]:
    """The model settings of the tuning grid (just `cfg` when no grid axis is set)."""
    axes = {name: getattr(cfg.tuning, name) for name in TUNED if getattr(cfg.tuning, name)}
    return [dataclasses.replace(cfg, **dict(zip(axes, values))) for values in itertools.product(*axes.values())]


def group_folds(groups: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Fold number per row: whole groups, in a seeded random order, largest first into the fold with
    the fewest rows so far."""
    labels, inverse, sizes = np.unique(groups, return_inverse=True, return_counts=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    fold_of, load = np.zeros(len(labels), dtype=int), np.zeros(folds)
    for i in sorted(order, key=lambda i: -sizes[i]):  # stable: equal sizes keep the random order
        fold_of[i] = int(np.argmin(load))
        load[fold_of[i]] += sizes[i]
    return fold_of[inverse]


def select_params(x: pd.DataFrame, targets: pd.DataFrame, y: np.ndarray, w: np.ndarray, index: np.ndarray,
                  cfg: SlowdownModelConfig, groups: np.ndarray | None = None) -> SlowdownModelConfig:
    """The grid candidate with the most kernels within 10 % in an inner cross-validation of `index` only
    (never the rows being evaluated outside it), among those meeting the summed-error limit. With
    `groups` (one label per row of x), the inner folds keep each group whole."""
    grid = candidates(cfg)
    if len(grid) == 1:
        return grid[0]
    if cfg.tuning.inner_folds < 2:
        raise ConfigError(f"hardware.slowdown.model.tuning.inner_folds={cfg.tuning.inner_folds}: "
                          "the inner cross-validation needs at least 2 folds; set "
                          "hardware.slowdown.model.tuning.inner_folds=2 or more")
    if groups is None:
        order = np.random.default_rng(cfg.random_state + 1).permutation(index)
        inner = np.array_split(order, cfg.tuning.inner_folds)
    else:
        fold = group_folds(groups[index], cfg.tuning.inner_folds, cfg.random_state + 1)
        inner = [index[fold == k] for k in range(cfg.tuning.inner_folds)]
    best, best_score = grid[0], -np.inf
    for candidate in grid:
        pred = np.empty(len(targets))
        for fold in inner:
            fit_on = np.setdiff1d(index, fold)
            pred[fold] = _predict(_fit(x.iloc[fit_on], y[fit_on], w[fit_on], candidate), x.iloc[fold])
        metrics = duration_metrics(targets.iloc[index], pred[index])
        summed = abs(metrics["summed_error_pct"])
        score = metrics["within_10_pct"] if summed <= cfg.tuning.summed_error_limit_pct else -summed
        if score > best_score:
            best, best_score = candidate, score
    return best


def tuned_values(cfg: SlowdownModelConfig) -> dict:
    return {name: getattr(cfg, name) for name in TUNED}


def categorize(features: pd.DataFrame, categories: dict[str, list[str]]) -> tuple[pd.DataFrame, dict[str, int]]:
    """Categorical columns with the model's fixed categories; values it never saw become missing and are counted."""
    out, unknown = features.copy(), {}
    for name, known in categories.items():
        values = out[name].fillna("").astype(str)
        seen = values.isin(known)
        unknown[name] = int((~seen).sum())
        out[name] = pd.Categorical(values.where(seen), categories=known)
    return out, unknown


def duration_weights(targets: pd.DataFrame, cfg: SlowdownModelConfig) -> np.ndarray:
    if not cfg.duration_weighting:
        return np.ones(len(targets))
    power = 1 if cfg.objective in ABSOLUTE_OBJECTIVES else 2
    share = targets["overlap_fraction"] * targets["solo_duration_s"] / targets["overlapped_duration_s"]
    return share.to_numpy(dtype=float) ** power


def stretched_duration(solo_s, fraction, slowdown) -> np.ndarray:
    """t = (1 - r) * t0 + r * t0 * (1 + s): only the overlapped part is slowed (Echo; method.md 1.3)."""
    solo, r, s = (np.asarray(x, dtype=float) for x in (solo_s, fraction, slowdown))
    return solo * (1.0 + r * s)


def duration_metrics(targets: pd.DataFrame, slowdown_pred: np.ndarray) -> dict:
    """Echo's predict.py figures for predicted slowdowns of `targets` (kernels with overlap)."""
    measured = targets["overlapped_duration_s"].to_numpy(dtype=float)
    predicted = stretched_duration(targets["solo_duration_s"], targets["overlap_fraction"], slowdown_pred)
    rel = np.abs(predicted - measured) / measured
    out = {f"within_{p}_pct": float(np.mean(rel < p / 100) * 100) for p in WITHIN}
    out.update(
        kernels=int(len(measured)),
        duration_rmse_s=float(np.sqrt(np.mean((predicted - measured) ** 2))),
        duration_mape_pct=float(np.mean(rel) * 100),
        slowdown_rmse=float(np.sqrt(np.mean((slowdown_pred - targets["slowdown"].to_numpy(dtype=float)) ** 2))),
        summed_error_pct=float((predicted.sum() - measured.sum()) / measured.sum() * 100),
    )
    return out


def baseline_factors(targets: pd.DataFrame) -> dict[str, float]:
    """One slowdown per device type: the mean measured slowdown (floored at 0), Proteus' constant factor."""
    means = targets.groupby("device_type")["slowdown"].mean()
    return {str(k): max(float(v), 0.0) for k, v in means.items()}


def baseline_predict(factors: dict[str, float], device_types: pd.Series) -> np.ndarray:
    fallback = float(np.mean(list(factors.values()))) if factors else 0.0
    return device_types.map(lambda d: factors.get(str(d), fallback)).to_numpy(dtype=float)


def _fit(x: pd.DataFrame, y: np.ndarray, w: np.ndarray, cfg: SlowdownModelConfig) -> xgb.Booster:
    import xgboost as xgb

    data = xgb.DMatrix(x, label=y, weight=w, enable_categorical=True)
    return xgb.train(xgb_params(cfg), data, num_boost_round=cfg.n_estimators)


def _predict(booster: xgb.Booster, x: pd.DataFrame) -> np.ndarray:
    import xgboost as xgb

    return np.clip(booster.predict(xgb.DMatrix(x, enable_categorical=True)), 0.0, None)


def split_indices(n: int, cfg: SlowdownModelConfig) -> tuple[np.ndarray, list[np.ndarray]]:
    """(hold-out indices, cross-validation folds of the rest), from a permutation seeded by random_state."""
    if not 0 < cfg.holdout_fraction < 1 or cfg.cv_folds < 2:
        raise ConfigError(f"hardware.slowdown.model: holdout_fraction={cfg.holdout_fraction} must be in (0, 1) and "
                          f"cv_folds={cfg.cv_folds} at least 2")
    n_holdout = int(round(n * cfg.holdout_fraction))
    if n - n_holdout < cfg.cv_folds or n_holdout < 1:
        raise ConfigError(f"slowdown dataset has {n} overlapped kernels: too few for a {cfg.holdout_fraction} "
                          f"hold-out and {cfg.cv_folds} folds; collect more (hardware.slowdown.repeats, sizes)")
    order = np.random.default_rng(cfg.random_state).permutation(n)
    return order[:n_holdout], np.array_split(order[n_holdout:], cfg.cv_folds)


def kernel_groups(rows: pd.DataFrame, bins_per_octave: int = 4) -> np.ndarray:
    """A group label per row: the kernel (full name, else op) and its solo duration in 1/`bins_per_octave`
    octave bins. Rows of one kernel at one size (the same layer's kernel in every layer and step) share a
    label, so a cross-validation that folds by it never tests on a kernel it trained on."""
    name = rows["kernel_name"].fillna("").astype(str) if "kernel_name" in rows else pd.Series("", index=rows.index)
    name = name.where(name != "", rows["op"].astype(str))
    size = np.round(np.log2(rows["solo_duration_s"].to_numpy(dtype=float)) * bins_per_octave).astype(int)
    return (name + "@" + pd.Series(size, index=rows.index).astype(str)).to_numpy()


def grouped_cv(dataset: pd.DataFrame, cfg: SlowdownModelConfig, folds: int = 5,
               groups: np.ndarray | None = None) -> pd.DataFrame:
    """Out-of-fold predictions for every target kernel (status 'ok'), folded by `groups` (one label per
    target; default `kernel_groups`, so a kernel group is never on both sides), hyperparameters chosen
    by an inner cross-validation of each fold's training part that keeps the groups whole too. Features
    are `dataset_features`, i.e. those the composer supplies. Columns: the targets' timing columns,
    group, fold, predicted_slowdown, predicted_duration_s."""
    features = model_features(cfg)
    targets = dataset[dataset["status"] == STATUS_OK].reset_index(drop=True)
    x_all = dataset_features(targets)[features]
    categories = {c: sorted(x_all[c].unique().tolist()) for c in CATEGORICAL if c in features}
    x_all, _ = categorize(x_all, categories)
    y, w = targets["slowdown"].to_numpy(dtype=float), duration_weights(targets, cfg)
    groups = kernel_groups(targets) if groups is None else np.asarray(groups)
    if len(groups) != len(targets):
        raise ValueError(f"grouped_cv: {len(groups)} group labels for {len(targets)} target kernels")
    fold = group_folds(groups, folds, cfg.random_state)
    pred = np.full(len(targets), np.nan)
    for k in range(folds):
        test, fit_on = np.flatnonzero(fold == k), np.flatnonzero(fold != k)
        fold_cfg = select_params(x_all, targets, y, w, fit_on, cfg, groups)
        pred[test] = _predict(_fit(x_all.iloc[fit_on], y[fit_on], w[fit_on], fold_cfg), x_all.iloc[test])
    out = targets[["instance_id", "op", "op_kind", "solo_duration_s", "overlapped_duration_s", "overlap_fraction",
                   "slowdown"]].copy()
    out["group"], out["fold"], out["predicted_slowdown"] = groups, fold, pred
    out["predicted_duration_s"] = stretched_duration(out["solo_duration_s"], out["overlap_fraction"], pred)
    return out


def held_out_group_scores(folds: pd.DataFrame) -> dict:
    """The model's out-of-fold predictions on unseen kernel groups (a grouped_cv frame) against predicting
    no slowdown for the same kernels: what `hardware.slowdown.use=auto` decides on (slowdown/choice.py)."""
    return {"kernels": int(len(folds)), "groups": int(folds["group"].nunique()), "folds": int(folds["fold"].nunique()),
            "model": duration_metrics(folds, folds["predicted_slowdown"].to_numpy(dtype=float)),
            "none": duration_metrics(folds, np.zeros(len(folds)))}


def _importances(booster: xgb.Booster, features: list[str]) -> pd.DataFrame:
    gain, weight = booster.get_score(importance_type="gain"), booster.get_score(importance_type="weight")
    total_gain = sum(gain.values()) or 1.0
    rows = [{"feature": f, "gain_share": gain.get(f, 0.0) / total_gain, "splits": int(weight.get(f, 0))}
            for f in features]
    return pd.DataFrame(rows).sort_values("gain_share", ascending=False).reset_index(drop=True)


def train_slowdown_model(dataset: pd.DataFrame, cfg: SlowdownModelConfig) -> TrainResult:
    """Cross-validate, fit on the training part, test on the hold-out, and compare with the baseline."""
    features = model_features(cfg)
    targets = dataset[dataset["status"] == STATUS_OK].reset_index(drop=True)
    x_all = dataset_features(targets)[features]  # the composer's overlap_features, on the dataset rows
    categories = {c: sorted(x_all[c].unique().tolist()) for c in CATEGORICAL if c in features}
    x_all, _ = categorize(x_all, categories)
    y, w = targets["slowdown"].to_numpy(dtype=float), duration_weights(targets, cfg)
    holdout, folds = split_indices(len(targets), cfg)
    train = np.concatenate(folds)

    model_pred, base_pred = np.full(len(targets), np.nan), np.full(len(targets), np.nan)
    split = np.full(len(targets), "", dtype=object)
    chosen = []  # per fold: the parameters its inner cross-validation selected (nested CV)
    for k, fold in enumerate(folds):
        fit_on = np.setdiff1d(train, fold)
        fold_cfg = select_params(x_all, targets, y, w, fit_on, cfg)
        chosen.append(tuned_values(fold_cfg))
        model_pred[fold] = _predict(_fit(x_all.iloc[fit_on], y[fit_on], w[fit_on], fold_cfg), x_all.iloc[fold])
        base_pred[fold] = baseline_predict(baseline_factors(targets.iloc[fit_on]), targets["device_type"].iloc[fold])
        split[fold] = f"cv{k}"
    grid_size, configured = len(candidates(cfg)), cfg
    cfg = select_params(x_all, targets, y, w, train, cfg)  # the final model's parameters: inner CV of the 80 % part
    booster = _fit(x_all.iloc[train], y[train], w[train], cfg)
    factors = baseline_factors(targets.iloc[train])
    model_pred[holdout] = _predict(booster, x_all.iloc[holdout])
    base_pred[holdout] = baseline_predict(factors, targets["device_type"].iloc[holdout])
    split[holdout] = "holdout"

    def evaluate(index: np.ndarray) -> dict:
        part = targets.iloc[index]
        return {"model": duration_metrics(part, model_pred[index]),
                "baseline": duration_metrics(part, base_pred[index])}

    metrics = {
        "rows": {**status_counts(dataset), "targets": int(len(targets)), "train": int(len(train)),
                 "holdout": int(len(holdout))},
        "cv": evaluate(train), "holdout": evaluate(holdout), "baseline_factors": factors,
        "params": xgb_params(cfg) | {"n_estimators": cfg.n_estimators, "duration_weighting": cfg.duration_weighting},
        "tuning": {"grid_size": grid_size, "cv_fold_params": chosen, "final_params": tuned_values(cfg)}
        if grid_size > 1 else {},
        HELD_OUT_GROUPS: held_out_group_scores(grouped_cv(dataset, configured)),
    }
    from importlib.metadata import version

    schema = {"schema_version": SCHEMA_VERSION, "model": "xgboost", "xgboost_version": version("xgboost"),
              "target": "slowdown", "feature_names": features, "categories": categories,
              "device_types": sorted(targets["device_type"].unique().tolist()), "baseline_factors": factors,
              "params": metrics["params"]}
    predictions = pd.DataFrame({
        "instance_id": targets["instance_id"], "split": split, "op": targets["op"], "op_kind": targets["op_kind"],
        "overlap_fraction": targets["overlap_fraction"], "solo_duration_s": targets["solo_duration_s"],
        "overlapped_duration_s": targets["overlapped_duration_s"], "slowdown": y,
        "predicted_slowdown": model_pred, "baseline_slowdown": base_pred,
        "predicted_duration_s": stretched_duration(targets["solo_duration_s"], targets["overlap_fraction"], model_pred),
    })
    return TrainResult(booster, schema, metrics, _importances(booster, features), predictions)
